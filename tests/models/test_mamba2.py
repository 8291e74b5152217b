"""Mamba-2 through LLM against transformers' Mamba2ForCausalLM on a tiny random checkpoint.

Parity goes through llmhal.testing.engine_parity (prompts of 1 to 29 tokens, which cross the tiny
model's 16-token SSD chunks); ``max_num_batched_tokens=8`` cuts prompts into chunks whose state is
carried from one step to the next. ``force_preemption`` serves test_mamba.py too.
"""

from __future__ import annotations

import pytest

from llmhal import LLM, SamplingParams
from llmhal.entrypoints import generate
from llmhal.testing.engine_parity import PROMPTS, compare_with_references, hf_references


def force_preemption(llm, num_blocks):
    """Give the engine a block pool of ``num_blocks`` (the state slots unchanged), so growing
    requests preempt each other: a pure state-space model's blocks are bookkeeping only, and
    would otherwise never run out."""
    from llmhal.engine.state_cache import StateCacheManager

    eng = llm.engine
    old = eng.kv
    kv = StateCacheManager(num_blocks, old.block_size, old.num_slots)
    eng.kv = eng.scheduler.kv = eng.runner.state_cache = kv
    return kv


@pytest.fixture(scope="module")
def mamba2(tiny_models):
    folder, model = tiny_models("mamba2")
    return folder, model, hf_references(model, PROMPTS, 64)


def test_greedy_tokens_and_logprobs_match_transformers_batched(mamba2):
    folder, _, refs = mamba2
    llm = LLM(folder, dtype="float32", max_num_seqs=4)
    assert llm.engine.runner.attention_backends == ["mamba2_attn"]
    assert not llm.engine.runner.layers  # no attention layer: no KV memory
    assert not llm.engine.config.cache.enable_prefix_caching
    assert compare_with_references(llm, refs) == []
    # Every slot is back once the requests are done.
    assert llm.engine.kv.num_free_slots == llm.engine.kv.num_slots


def test_chunked_prefill_carries_the_state_and_mixes_with_decodes(mamba2):
    folder, _, refs = mamba2
    llm = LLM(folder, dtype="float32", max_num_seqs=4, max_num_batched_tokens=8)
    assert compare_with_references(llm, refs) == []


def test_preemption_frees_the_slot_and_recomputes(mamba2):
    folder, _, refs = mamba2
    llm = LLM(folder, dtype="float32", max_num_seqs=4, block_size=16)
    kv = force_preemption(llm, num_blocks=9)
    assert compare_with_references(llm, refs) == []
    assert llm.engine.scheduler.num_preemptions > 0
    assert kv.num_free_slots == kv.num_slots and kv.num_free_blocks == 9


def test_few_state_slots_limit_concurrency_not_results(mamba2):
    folder, _, refs = mamba2
    probe = LLM(folder, dtype="float32", max_num_seqs=4)
    per_slot = probe.engine.runner.state_bytes_per_slot()
    llm = LLM(folder, dtype="float32", max_num_seqs=4, kv_cache_memory_bytes=2 * per_slot + 1)
    assert llm.engine.kv.num_slots == 2  # four prompts, two at a time
    assert llm.load_report.max_concurrency == 2 and llm.load_report.num_state_slots == 2
    assert llm.load_report.kv_cache_bytes == 2 * per_slot  # states only: no KV memory
    assert compare_with_references(llm, refs) == []


def test_a_budget_below_one_state_is_refused_naming_the_remedy(mamba2):
    with pytest.raises(ValueError, match="recurrent state of one sequence.*kv_cache_memory_bytes"):
        LLM(mamba2[0], dtype="float32", kv_cache_memory_bytes=1000)


def test_abort_frees_the_slot(mamba2):
    llm = LLM(mamba2[0], dtype="float32", max_num_seqs=2)
    eng = llm.engine
    rid = eng.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=50))
    eng.step()
    assert eng.kv.num_free_slots == eng.kv.num_slots - 1
    eng.abort_request(rid)
    assert eng.kv.num_free_slots == eng.kv.num_slots


def test_sampling_and_structured_outputs_run(mamba2):
    from llmhal.structured_output.params import StructuredOutputsParams

    llm = LLM(mamba2[0], dtype="float32")
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)
    a = llm.generate(["abc"], seeded)[0].outputs[0].token_ids
    assert a == llm.generate(["abc"], seeded)[0].outputs[0].token_ids and len(a) == 12
    choice = SamplingParams(
        temperature=0,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    assert llm.generate(["Answer:"], choice)[0].outputs[0].text in ("yes", "no")


def test_generate_cli_runs_the_model(mamba2, capsys):
    argv = ["--model", mamba2[0], "--prompt", "Paris", "--max-tokens", "5", "--dtype", "float32"]
    assert generate.main(argv) == 0
    summary = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[llmhal]")]
    assert len(summary) == 1 and "mamba2_attn" in summary[0]


def test_serve_streams_what_the_offline_api_generates(mamba2):
    from llmhal.testing.http_client import post_json, running_server

    llm = LLM(mamba2[0], dtype="float32", max_num_seqs=4)
    offline = llm.generate(["Paris is"], SamplingParams(temperature=0, max_tokens=8))[0]
    body = {"model": mamba2[0], "prompt": "Paris is", "max_tokens": 8, "temperature": 0}
    with running_server(llm) as (url, _):
        status, events = post_json(f"{url}/v1/completions", {**body, "stream": True}, stream=True)
    assert status == 200 and len(events) > 1
    assert "".join(e["choices"][0]["text"] for e in events) == offline.outputs[0].text


def test_speculative_decoding_is_refused_naming_why(mamba2):
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="Speculative decoding is not supported.*mamba2"):
        LLM(mamba2[0], dtype="float32", speculative_config=spec)


def test_a_config_without_positions_sets_no_context_limit():
    from transformers import Mamba2Config

    from llmhal.engine.builder import derive_max_model_len

    assert derive_max_model_len(Mamba2Config(), None) == 2048  # the default when none is asked
    assert derive_max_model_len(Mamba2Config(), 100_000) == 100_000


def test_untied_head_projection_biases_and_one_group_match_transformers(tiny_models):
    variant = dict(tie_word_embeddings=False, use_bias=True, n_groups=1, use_conv_bias=False)
    folder, model = tiny_models("mamba2", **variant)
    refs = hf_references(model, PROMPTS, 16)
    llm = LLM(folder, dtype="float32", max_num_seqs=4, max_num_batched_tokens=8)
    assert compare_with_references(llm, refs) == []
