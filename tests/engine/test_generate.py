"""LLM API behaviour: sampling, stopping, validation, chat, and recovery from bad input."""

from __future__ import annotations

import pytest

from llmhal import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_models):
    folder, _ = tiny_models("llama")
    return LLM(folder, dtype="float32", max_model_len=128)


def _ids(out):
    return out.outputs[0].token_ids


def test_seeded_sampling_is_reproducible_and_seeds_differ(llm):
    p = {"prompt_token_ids": [5, 6, 7]}
    a = llm.generate(p, SamplingParams(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True))[0]
    b = llm.generate(p, SamplingParams(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True))[0]
    c = llm.generate(p, SamplingParams(temperature=1.0, seed=2, max_tokens=24, ignore_eos=True))[0]
    assert _ids(a) == _ids(b)
    assert _ids(a) != _ids(c)


def test_seeded_request_is_independent_of_batch_mates(llm):
    p = {"prompt_token_ids": [9, 8, 7, 6]}
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate(p, params)[0]
    other = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    together = llm.generate([{"prompt_token_ids": [1, 2]}, p], [other, params])[1]
    assert _ids(alone) == _ids(together)


def test_top_k_one_equals_greedy(llm):
    p = {"prompt_token_ids": [40, 41, 42]}
    greedy = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    topk = llm.generate(
        p, SamplingParams(temperature=1.5, top_k=1, seed=0, max_tokens=12, ignore_eos=True)
    )[0]
    minp = llm.generate(
        p, SamplingParams(temperature=1.5, min_p=1.0, seed=0, max_tokens=12, ignore_eos=True)
    )[0]
    assert _ids(greedy) == _ids(topk) == _ids(minp)


def test_max_tokens_and_finish_reason(llm):
    out = llm.generate(
        {"prompt_token_ids": [3, 4]}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )[0]
    assert len(_ids(out)) == 5
    assert out.outputs[0].finish_reason == "length"
    assert out.finished


def test_stop_token_ids(llm):
    p = {"prompt_token_ids": [3, 4]}
    free = _ids(llm.generate(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0])
    stop_at = free[3]
    out = llm.generate(
        p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_at])
    )[0]
    first = free.index(stop_at)
    assert _ids(out) == free[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


def test_stop_string_truncates_text(llm):
    p = {"prompt_token_ids": [3, 4]}
    free = (
        llm.generate(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    stop = free[5:8]
    if not stop.strip():
        pytest.skip("tiny model text has no usable stop string")
    out = llm.generate(
        p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert out.text == free[: free.index(stop)]
    assert out.stop_reason == stop
    kept = llm.generate(
        p,
        SamplingParams(
            temperature=0,
            max_tokens=20,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )[0]
    assert kept.outputs[0].text == free[: free.index(stop) + len(stop)]


def test_logprobs_are_returned(llm):
    out = llm.generate(
        {"prompt_token_ids": [3]},
        SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
    )[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    tok_text = llm.get_tokenizer()
    for tok, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert tok in entry and len(entry) >= 3
        # greedy picks the most likely token: rank 1; the top 3 are ranked 1, 2, 3 (vLLM's Logprob)
        assert max(e.logprob for e in entry.values()) == entry[tok].logprob
        assert entry[tok].rank == 1 and sorted(e.rank for e in entry.values()) == [1, 2, 3]
        for t, e in entry.items():
            assert e.decoded_token == tok_text.decode([t], skip_special_tokens=False)
    assert c.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True))
    )


def test_prompt_too_long_raises_before_work_and_llm_stays_usable(llm):
    ok = {"prompt_token_ids": [1, 2, 3]}
    too_long = {"prompt_token_ids": [5] * 200}
    with pytest.raises(ValueError, match=r"200 tokens.*128"):
        llm.generate([ok, too_long], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(ok, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(_ids(out)) == 3


def test_generation_stops_at_context_length(llm):
    out = llm.generate(
        {"prompt_token_ids": [7] * 120},
        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
    )[0]
    assert len(_ids(out)) == 8
    assert out.outputs[0].finish_reason == "length"


def test_string_prompts_and_chat(llm):
    out = llm.generate(
        "The capital of France", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )[0]
    assert out.prompt == "The capital of France"
    assert out.prompt_token_ids == llm.get_tokenizer().encode("The capital of France")
    chat = llm.chat(
        [{"role": "user", "content": "hi"}],
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    )[0]
    assert chat.prompt.startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert len(_ids(chat)) == 3


def test_malformed_chat_messages_are_a_clear_error(llm):
    for messages, match in [
        ([{"role": "user"}], r"message 0 .*'content'"),
        ([{"role": "user", "content": "hi"}, "hello"], r"message 1 .*dict"),
        ([{"content": "hi"}], r"message 0 .*'role'"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.chat(messages, SamplingParams(max_tokens=2))
    assert llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))


def test_invalid_sampling_params_are_rejected():
    for kwargs, match in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n must be at least 1"),
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"top_p": float("inf")}, "top_p must be finite"),
        ({"seed": "abc"}, "seed must be an integer"),
        ({"seed": 2**64}, "seed must fit in 64 bits"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer"),
        ({"logprobs": True}, "logprobs must be an integer"),
        ({"stop": 5}, "stop must be a string or a list"),
        ({"stop": ["ok", 3]}, "stop must be a string or a list"),
        ({"stop_token_ids": "abc"}, "stop_token_ids must be a list"),
        ({"stop_token_ids": [1, 2.0]}, "stop_token_ids must be a list"),
        ({"ignore_eos": 1}, "ignore_eos must be true or false"),
    ]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kwargs)
    # Integer and real types other than int and float (numpy's) are numbers too.
    import numpy as np

    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), stop_token_ids=(1, 2))
    assert p.stop_token_ids == [1, 2]


def test_kv_cache_too_small_for_one_request_is_a_clear_error(tiny_models):
    folder, _ = tiny_models("llama")
    llm = LLM(folder, dtype="float32", kv_cache_memory_bytes=2 * 8192)
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate({"prompt_token_ids": [1] * 40}, SamplingParams(max_tokens=10))
    assert (
        len(
            _ids(
                llm.generate(
                    {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=4, ignore_eos=True)
                )[0]
            )
        )
        == 4
    )


def test_platform_may_change_the_block_size(tiny_models, monkeypatch):
    # check_and_update_config may adjust the config in place (Platform's contract): a platform
    # whose attention needs other pages sets the block size there. The KV cache, its manager and
    # the runner must all follow it (the manager once kept the user's value and ran out of blocks).
    from llmhal.platforms import get_current_platform

    platform = get_current_platform()
    original = type(platform).check_and_update_config

    def with_block_8(self, config):
        original(self, config)
        config.cache.block_size = 8

    folder, _ = tiny_models("llama")
    p = {"prompt_token_ids": list(range(3, 34))}  # 31 tokens: 4 blocks of 8, 2 of 16
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = LLM(folder, dtype="float32", max_model_len=128).generate(p, params)[0]
    monkeypatch.setattr(type(platform), "check_and_update_config", with_block_8)
    llm = LLM(folder, dtype="float32", max_model_len=128)
    assert llm.engine.config.cache.block_size == 8
    assert _ids(llm.generate(p, params)[0]) == _ids(want)


def test_an_unknown_kv_cache_dtype_is_named_before_loading(tiny_models):
    folder, _ = tiny_models("llama")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='NOPE' is not one of auto, fp8_e4m3"):
        LLM(folder, kv_cache_dtype="NOPE")


def test_a_model_without_tokenizer_files_names_them_and_the_remedy(tiny_models, tmp_path):
    import shutil
    from pathlib import Path

    folder, _ = tiny_models("llama")
    bare = tmp_path / "bare"
    shutil.copytree(
        folder,
        bare,
        ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*", "special_tokens*"),
    )
    with pytest.raises(
        ValueError, match=r"bare \(the model folder\) has no tokenizer files.*--tokenizer"
    ):
        LLM(str(bare), dtype="float32")
    with pytest.raises(
        ValueError, match=r"tokenizer='/no/such/tok' does not exist.*never downloads"
    ):
        LLM(str(bare), dtype="float32", tokenizer="/no/such/tok")
    llm = LLM(str(bare), dtype="float32", tokenizer=folder, max_model_len=64)  # the remedy works
    assert llm.generate("hi", SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids
    assert not any(Path(bare).glob("tokenizer*"))


def test_rope_scaling_raises_the_context_a_request_may_ask_for(tmp_path):
    from llmhal.engine.builder import derive_max_model_len
    from llmhal.testing.tiny_models import make_tiny_model, tiny_config

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    yarn["original_max_position_embeddings"] = 512
    cfg = tiny_config("qwen2", max_position_embeddings=512, rope_parameters=yarn)
    assert derive_max_model_len(cfg, None) == 512  # the extended context is opt-in
    assert derive_max_model_len(cfg, 2048) == 2048
    with pytest.raises(ValueError, match=r"yarn RoPE scaling's limit \(512 x 4 = 2048\)"):
        derive_max_model_len(cfg, 2049)
    dyn = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    assert (
        derive_max_model_len(
            tiny_config("llama", max_position_embeddings=256, rope_parameters=dyn), 512
        )
        == 512
    )
    plain = tiny_config("llama", max_position_embeddings=256)
    with pytest.raises(
        ValueError, match=r"the model's max_position_embeddings \(256\); use at most 256"
    ):
        derive_max_model_len(plain, 257)
    # And an engine runs the extended context (yarn is one static table, as in HF).
    make_tiny_model(tmp_path / "q", "qwen2", max_position_embeddings=512, rope_parameters=yarn)
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_model_len=1024)
    out = llm.generate(
        {"prompt_token_ids": [3] * 700}, SamplingParams(max_tokens=2, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 2


def test_a_malformed_quantization_config_is_named(tiny_models, tmp_path):
    import json
    import shutil

    folder, _ = tiny_models("llama")
    for qc, match in [
        ("gptq", r"quantization_config must be an object with a quant_method, got 'gptq'"),
        ({"bits": 4, "group_size": 32}, r"quantization_config has no quant_method"),
    ]:
        bad = tmp_path / f"m{len(match)}"
        shutil.copytree(folder, bad)
        cfg = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
        with pytest.raises(ValueError, match=match):
            LLM(str(bad), dtype="float32")


def test_the_load_warm_up_leaves_no_trace(tiny_models, monkeypatch):
    """LLM() runs a warm-up request at load; afterwards the engine is as if it never ran: no
    request, every KV block free, zero statistics, and unseeded sampling draws the same numbers."""
    from llmhal.engine.llm_engine import LLMEngine

    folder, _ = tiny_models("llama")
    ran = []
    real = LLMEngine.warmup
    monkeypatch.setattr(LLMEngine, "warmup", lambda self: ran.append(real(self)))
    warmed = LLM(folder, dtype="float32", max_model_len=128)
    assert len(ran) == 1
    engine = warmed.engine
    assert not engine.has_unfinished_requests() and not engine._requests
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.stats.steps == engine.stats.decode_tokens == engine.stats.prefill_tokens == 0
    monkeypatch.setattr(LLMEngine, "warmup", lambda self: None)
    cold = LLM(folder, dtype="float32", max_model_len=128)
    prompts = ["hello there", {"prompt_token_ids": [5, 6, 7]}]
    sampled = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)  # global RNG
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for params in (sampled, greedy):
        assert [_ids(o) for o in warmed.generate(prompts, params)] == [
            _ids(o) for o in cold.generate(prompts, params)
        ]


def test_no_warm_up_where_the_context_cannot_hold_it(tiny_models):
    folder, _ = tiny_models("llama")
    llm = LLM(folder, dtype="float32", max_model_len=6)  # 4 prompt + 3 new tokens do not fit
    out = llm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(_ids(out[0])) == 3


def test_a_request_that_exactly_fills_the_kv_cache_is_accepted(tiny_models):
    """The last sampled token never takes a KV slot: prompt + max_tokens - 1 slots suffice."""
    folder, _ = tiny_models("llama")
    probe = LLM(folder, dtype="float32", max_model_len=64, block_size=1)
    per_token = probe.engine.runner.kv_cache_bytes_per_block()
    llm = LLM(folder, dtype="float32", max_model_len=64, block_size=1,
              kv_cache_memory_bytes=32 * per_token)  # fmt: skip
    prompt = {"prompt_token_ids": list(range(10, 26))}  # 16 tokens: 16 + 17 - 1 = 32 slots
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=17, ignore_eos=True))[0]
    assert len(_ids(out)) == 17
    with pytest.raises(ValueError, match="needs 33 tokens of KV cache"):
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=18, ignore_eos=True))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer, got 0"),
        ({"block_size": 0}, "block_size must be a positive integer, got 0"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens must be a positive integer"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be a positive integer"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes must be a positive integer"),
        ({"max_model_len": 2.5}, "max_model_len must be a positive integer or None, got 2.5"),
    ],
)
def test_sizes_must_be_positive_integers_and_are_named_before_loading(tiny_models, kwargs, message):
    folder, _ = tiny_models("llama")
    with pytest.raises(ValueError, match=message):
        LLM(folder, **kwargs)
