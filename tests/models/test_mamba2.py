"""Mamba-2 through LLM against transformers' Mamba2ForCausalLM on a tiny random checkpoint.

The parity helpers here (``hf_greedy``, ``differences``) serve test_mamba.py too. Prompts of 1 to
40 tokens cross the tiny model's 16-token SSD chunks; ``max_num_batched_tokens=8`` cuts prompts
into chunks whose state is carried from one step to the next.
"""

from __future__ import annotations

import pytest
import torch

from llmhal import LLM, SamplingParams
from llmhal.entrypoints import generate

PROMPTS = ((5, 17, 42), (7, 100, 23, 9, 88, 64, 3, 250, 31), (300,), tuple(range(11, 51)))
STEPS = 64


def hf_greedy(model, prompts=PROMPTS, steps=STEPS):
    """transformers' greedy tokens and float32 log-probabilities for each prompt (no EOS stop)."""
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([list(p)]), max_new_tokens=steps, min_new_tokens=steps,
                do_sample=False, output_scores=True, return_dict_in_generate=True,
                pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        lps = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), -1)
        refs.append((out.sequences[0, len(p) :].tolist(), lps))
    return refs


def differences(llm, refs, prompts=PROMPTS, atol=2e-4):
    """Generate every prompt in one batch; the ways the result differs from ``refs``."""
    steps = len(refs[0][0])
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params)
    problems = []
    for p, (tokens, lps), out in zip(prompts, refs, outs, strict=True):
        got = out.outputs[0]
        if got.token_ids != tokens:
            first = next(
                i for i, (a, b) in enumerate(zip(got.token_ids, tokens, strict=False)) if a != b
            )
            problems.append(f"{len(p)}-token prompt: tokens differ from step {first}")
            continue
        worst = max(
            abs(lp.logprob - float(lps[i, t]))
            for i, e in enumerate(got.logprobs)
            for t, lp in e.items()
        )
        if worst > atol:
            problems.append(f"{len(p)}-token prompt: logprob off by {worst:.2e}")
    return problems


def force_preemption(llm, num_blocks):
    """Give the engine a block pool of ``num_blocks`` (the state slots unchanged), so growing
    requests preempt each other: a pure state-space model's blocks are bookkeeping only, and
    would otherwise never run out."""
    from llmhal.engine.state_cache import StateCacheManager

    eng = llm.engine
    old = eng.kv
    kv = StateCacheManager(
        num_blocks, old.block_size, old.num_slots, reset_slot=eng.runner.reset_state_slot
    )
    eng.kv = eng.scheduler.kv = eng.runner.state_cache = kv
    return kv


@pytest.fixture(scope="module")
def mamba2(tiny_models):
    folder, model = tiny_models("mamba2")
    return folder, model, hf_greedy(model)


def test_greedy_tokens_and_logprobs_match_transformers_batched(mamba2):
    folder, _, refs = mamba2
    llm = LLM(folder, dtype="float32", max_num_seqs=4)
    assert llm.engine.runner.attention_backends == ["mamba2_attn"]
    assert not llm.engine.runner.layers  # no attention layer: no KV memory
    assert not llm.engine.config.cache.enable_prefix_caching
    assert differences(llm, refs) == []
    # Every slot is back once the requests are done.
    assert llm.engine.kv.num_free_slots == llm.engine.kv.num_slots


def test_chunked_prefill_carries_the_state_and_mixes_with_decodes(mamba2):
    folder, _, refs = mamba2
    llm = LLM(folder, dtype="float32", max_num_seqs=4, max_num_batched_tokens=8)
    assert differences(llm, refs) == []


def test_preemption_frees_the_slot_and_recomputes(mamba2):
    folder, _, refs = mamba2
    llm = LLM(folder, dtype="float32", max_num_seqs=4, block_size=16)
    kv = force_preemption(llm, num_blocks=9)
    assert differences(llm, refs) == []
    assert llm.engine.scheduler.num_preemptions > 0
    assert kv.num_free_slots == kv.num_slots and kv.num_free_blocks == 9


def test_few_state_slots_limit_concurrency_not_results(mamba2):
    folder, _, refs = mamba2
    probe = LLM(folder, dtype="float32", max_num_seqs=4)
    per_slot = probe.engine.runner.state_bytes_per_slot()
    llm = LLM(folder, dtype="float32", max_num_seqs=4, kv_cache_memory_bytes=2 * per_slot + 1)
    assert llm.engine.kv.num_slots == 2  # four prompts, two at a time
    assert differences(llm, refs) == []


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
