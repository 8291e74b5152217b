"""vLLM's offline API conventions that ported code relies on: keywords, penalties, stop handling,
chat message shapes, output fields, and errors instead of silently ignored arguments."""

from __future__ import annotations

import pytest
import torch

from llmhal import LLM, SamplingParams

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tiny_models):
    folder, hf = tiny_models("llama")
    return LLM(folder, dtype="float32", max_model_len=128), hf


def _gen(llm, prompt, **kw):
    return llm.generate({"prompt_token_ids": prompt}, SamplingParams(**kw), use_tqdm=False)[0]


def test_unknown_engine_arguments_are_an_error_not_ignored(tiny_models):
    folder, _ = tiny_models("llama")
    with pytest.raises(TypeError, match="does not support: enable_lora, gpu_memory_utilization"):
        LLM(folder, gpu_memory_utilization=0.5, enable_lora=True)
    with pytest.raises(ValueError, match="use 'mp', 'ray' or 'external_launcher'"):
        LLM(folder, tensor_parallel_size=2, distributed_executor_backend="uni")
    llm = LLM(
        folder, dtype="float32", max_model_len=64, trust_remote_code=True, tensor_parallel_size=1
    )
    assert _gen(llm, [5, 6], max_tokens=2, **GREEDY).outputs[0].token_ids


def test_a_tiny_temperature_is_greedy_and_does_not_fail_the_batch(tiny):
    llm, _ = tiny
    greedy = _gen(llm, [5, 6, 7], max_tokens=6, **GREEDY).outputs[0].token_ids
    outs = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}],
        [SamplingParams(temperature=1e-40, max_tokens=6, ignore_eos=True), SamplingParams()],
    )
    assert outs[0].outputs[0].token_ids == greedy


def test_unknown_prompt_keys_are_refused(tiny):
    llm, _ = tiny
    with pytest.raises(ValueError, match="does not support 'multi_modal_data'"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": 1}})


def test_stop_strings_wait_for_min_tokens(tiny):
    llm, _ = tiny
    first = _gen(llm, [5, 6, 7], max_tokens=8, **GREEDY).outputs[0]
    tok = llm.get_tokenizer()
    stop = tok.decode(first.token_ids[:1])
    assert stop.strip(), "the first token must have visible text for this test"
    early = _gen(llm, [5, 6, 7], max_tokens=8, stop=[stop], **GREEDY).outputs[0]
    assert len(early.token_ids) == 1 and early.finish_reason == "stop"
    late = _gen(llm, [5, 6, 7], max_tokens=8, stop=[stop], min_tokens=3, **GREEDY).outputs[0]
    assert len(late.token_ids) >= 3


def test_a_stop_token_is_in_token_ids_but_not_in_the_text(tiny):
    llm, _ = tiny
    ref = _gen(llm, [5, 6, 7], max_tokens=8, **GREEDY).outputs[0]
    stop_id = ref.token_ids[3]
    n = ref.token_ids.index(stop_id) + 1
    out = _gen(llm, [5, 6, 7], max_tokens=8, stop_token_ids=[stop_id], **GREEDY).outputs[0]
    assert out.token_ids == ref.token_ids[:n] and out.stop_reason == stop_id
    assert out.text == _gen(llm, [5, 6, 7], max_tokens=n - 1, **GREEDY).outputs[0].text
    kept = _gen(
        llm, [5, 6, 7], max_tokens=8, stop_token_ids=[stop_id], include_stop_str_in_output=True,
        **GREEDY,
    ).outputs[0]  # fmt: skip
    assert kept.text == _gen(llm, [5, 6, 7], max_tokens=n, **GREEDY).outputs[0].text


def test_repetition_penalty_matches_transformers(tiny):
    llm, hf = tiny
    for prompt in ([5, 6, 7, 5, 6], [9, 9, 9]):
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.7,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt) :].tolist()  # fmt: skip
        got = _gen(llm, prompt, max_tokens=12, repetition_penalty=1.7, **GREEDY).outputs[0]
        assert got.token_ids == ref
        favoured = _gen(llm, prompt, max_tokens=12, repetition_penalty=0.3, **GREEDY).outputs[0]
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=0.3,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt) :].tolist()  # fmt: skip
        assert favoured.token_ids == ref
        assert ref != _gen(llm, prompt, max_tokens=12, **GREEDY).outputs[0].token_ids


def _penalised_greedy(hf, prompt, n, presence, frequency):
    """OpenAI's presence/frequency rule on the transformers model's logits, one token at a time."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].clone()
        for t in set(out):
            logits[t] -= presence + frequency * out.count(t)
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


def test_presence_and_frequency_penalties_follow_openais_rule(tiny):
    llm, hf = tiny
    plain = _gen(llm, [5, 6, 7], max_tokens=16, **GREEDY).outputs[0].token_ids
    changed = 0
    # Negative values favour repeats, which this random model's greedy output never has otherwise.
    for presence, frequency in ((1.5, 0.0), (0.0, -0.7), (-2.0, 0.5)):
        got = _gen(
            llm, [5, 6, 7], max_tokens=16, presence_penalty=presence,
            frequency_penalty=frequency, **GREEDY,
        ).outputs[0].token_ids  # fmt: skip
        assert got == _penalised_greedy(hf, [5, 6, 7], 16, presence, frequency)
        changed += got != plain
    assert changed, "the penalties should change some of these greedy outputs"


def test_logprobs_are_the_models_own_before_penalties(tiny):
    llm, hf = tiny
    out = _gen(llm, [5, 6, 7], max_tokens=1, repetition_penalty=3.0, logprobs=0, **GREEDY)
    c = out.outputs[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([[5, 6, 7]])).logits[0, -1], -1)
    assert c.logprobs[0][c.token_ids[0]].logprob == pytest.approx(
        float(ref[c.token_ids[0]]), abs=1e-4
    )


def test_invalid_penalties_are_rejected():
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(ValueError, match=r"frequency_penalty must be in \[-2, 2\]"):
        SamplingParams(frequency_penalty=3)


def test_chat_takes_openai_message_shapes_and_vllms_keywords(tiny):
    llm, _ = tiny
    sp = SamplingParams(max_tokens=3, **GREEDY)
    plain = llm.chat([{"role": "user", "content": "hi there"}], sp)[0]
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    joined = llm.chat([{"role": "user", "content": parts}], sp)[0]
    assert joined.prompt == plain.prompt.replace("hi there", "hi\nthere")
    tool_turn = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        {"role": "user", "content": "again"},
    ]
    assert llm.chat(tool_turn, sp)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="content part of type 'image_url'"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], sp)
    # vLLM's third positional argument is use_tqdm, not add_generation_prompt.
    assert llm.chat([{"role": "user", "content": "hi there"}], sp, False)[0].prompt == plain.prompt
    custom = "{% for m in messages %}[{{ m.content }}|{{ flavour }}]{% endfor %}"
    out = llm.chat(
        [{"role": "user", "content": "hi"}], sp, chat_template=custom,
        chat_template_kwargs={"flavour": "mint"}, add_generation_prompt=False,
    )[0]  # fmt: skip
    assert out.prompt == "[hi|mint]"


def test_generate_accepts_use_tqdm_and_shows_a_bar_on_a_terminal(tiny, monkeypatch):
    import sys

    llm, _ = tiny
    bars = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    prompts = [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7]}]
    sp = SamplingParams(max_tokens=2, **GREEDY)
    llm.generate(prompts, sp, use_tqdm=Bar)  # captured stderr: no bar
    assert bars == []
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    llm.generate(prompts, sp, use_tqdm=False)
    assert bars == []
    llm.generate(prompts, sp, use_tqdm=Bar)
    assert len(bars) == 1 and bars[0].total == bars[0].n == 2 and bars[0].closed


def test_outputs_carry_vllms_fields(tiny):
    llm, _ = tiny
    out = _gen(llm, [5, 6], max_tokens=2, **GREEDY)
    assert out.prompt_logprobs is None and out.num_cached_tokens == 0
    assert out.outputs[0].finished() and out.finished


def _with_generation_config(folder, tmp_path, **settings):
    import json
    import shutil

    copy = tmp_path / "with_gen_cfg"
    shutil.copytree(folder, copy)
    path = copy / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    return str(copy)


def test_generation_config_supplies_the_default_sampling_params(tiny_models, tmp_path):
    folder, _ = tiny_models("llama")
    copy = _with_generation_config(folder, tmp_path, temperature=0.7, top_k=1, max_new_tokens=5)
    llm = LLM(copy, dtype="float32", max_model_len=64)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.max_tokens, d.top_p) == (0.7, 1, 5, 1.0)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3)  # top_k=1: every sample the same
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert len(outs[0].outputs[0].token_ids) == 5
    explicit = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))
    assert len(explicit[0].outputs[0].token_ids) == 2  # given params win whole
    plain = LLM(folder, dtype="float32", max_model_len=64).get_default_sampling_params()
    assert plain == SamplingParams()


def test_generation_config_settings_sampling_params_refuse_are_named(tiny_models, tmp_path):
    folder, _ = tiny_models("llama")
    llm = LLM(_with_generation_config(folder, tmp_path, top_p=0), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="generation_config.json .*top_p.*pass sampling_params"):
        llm.generate("hi")
    assert llm.generate("hi", SamplingParams(max_tokens=1))


def test_the_server_fills_left_out_fields_from_the_generation_config():
    from llmhal.entrypoints.openai_protocol import sampling_params

    defaults = {"temperature": 0.3, "max_tokens": 5, "top_k": 4}
    p = sampling_params({"prompt": "x", "top_k": 2}, chat=False, defaults=defaults)
    assert (p.temperature, p.max_tokens, p.top_k) == (0.3, 5, 2)


def test_n_completions_per_prompt(tiny):
    """vLLM's parallel sampling: n completions in one output, indexed; with a seed, the i-th is
    the single completion seeded seed + i."""
    llm, _ = tiny
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8]}]
    sp = SamplingParams(n=3, seed=11, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, [sp, SamplingParams(max_tokens=2, ignore_eos=True)])
    assert [len(o.outputs) for o in outs] == [3, 1]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    for i, c in enumerate(outs[0].outputs):
        alone = _gen(llm, [5, 6, 7], seed=11 + i, max_tokens=6, ignore_eos=True).outputs[0]
        assert c.token_ids == alone.token_ids and c.text == alone.text
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    assert outs[0].prompt_token_ids == [5, 6, 7] and outs[0].finished
    with pytest.raises(ValueError, match="n must be at least 1"):
        SamplingParams(n=0)


def _next_logits(hf, prompt):
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1]


def test_logit_bias_and_allowed_token_ids_shape_sampling(tiny):
    llm, hf = tiny
    prompt = [5, 6, 7]
    ref = _next_logits(hf, prompt)
    first, second = ref.topk(2).indices.tolist()
    # A strong bias forces a token; a strong negative one on the greedy choice gives the next best.
    forced = _gen(llm, prompt, max_tokens=4, logit_bias={9: 100.0}, **GREEDY).outputs[0]
    assert forced.token_ids == [9] * 4
    demoted = _gen(llm, prompt, max_tokens=1, logit_bias={first: -100}, logprobs=0, **GREEDY)
    c = demoted.outputs[0]
    assert c.token_ids == [second]
    # The log-probabilities stay the model's own (vLLM's default).
    assert c.logprobs[0][second].logprob == pytest.approx(
        float(torch.log_softmax(ref, -1)[second]), abs=1e-4
    )
    # Only the allowed tokens: greedy takes the likeliest of them, sampling never leaves them.
    allowed = [11, 12, 13]
    best = allowed[int(ref[allowed].argmax())]
    got = _gen(llm, prompt, max_tokens=1, allowed_token_ids=allowed, **GREEDY).outputs[0]
    assert got.token_ids == [best]
    sampled = _gen(llm, prompt, max_tokens=24, allowed_token_ids=allowed, temperature=1.5,
                   seed=0, ignore_eos=True).outputs[0]  # fmt: skip
    assert set(sampled.token_ids) <= set(allowed) and len(set(sampled.token_ids)) > 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logit_bias": {"a": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias values must be finite numbers"),
        ({"logit_bias": {1: 10**400}}, "logit_bias values must be finite numbers"),
        ({"logit_bias": {1: 1e39}}, r"logit_bias values must be in \[-100, 100\]"),
        ({"temperature": 10**400}, "temperature must be finite"),
        ({"logit_bias": [1, 2]}, "logit_bias must map token ids to numbers"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
        ({"allowed_token_ids": [1, "2"]}, "allowed_token_ids must be token ids"),
    ],
)
def test_bad_logit_shaping_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_token_ids_outside_the_vocabulary_are_refused_before_any_work(tiny):
    llm, _ = tiny
    for kwargs in ({"logit_bias": {10**9: 1.0}}, {"allowed_token_ids": [-1]}):
        name = next(iter(kwargs))
        with pytest.raises(ValueError, match=f"{name} contain ids outside the vocabulary"):
            _gen(llm, [5, 6], **kwargs)
    # Nothing could be sampled: the only allowed tokens are stop tokens min_tokens forbids.
    with pytest.raises(ValueError, match="are all stop or EOS tokens"):
        _gen(llm, [5, 6], allowed_token_ids=[7], stop_token_ids=[7], min_tokens=1)
    assert _gen(llm, [5, 6], allowed_token_ids=[7], stop_token_ids=[7], max_tokens=2).outputs
    assert not llm.engine.has_unfinished_requests()
