"""SamplingParams(prompt_logprobs=k): every prompt token's log-probability given the tokens before
it, checked against transformers' logits; chunked prefill and preemption add nothing twice."""

from __future__ import annotations

import pytest
import torch

from llmhal import LLM, SamplingParams

PROMPT = [5, 17, 3, 99, 42, 7, 7, 64, 12, 5, 88, 31, 2, 19, 50, 6, 6, 73, 21, 9]


def _reference(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' log-probabilities of the whole vocabulary after each prompt position."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)


def _check(entries, hf, prompt: list[int], k: int) -> None:
    ref = _reference(hf, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        entry, row, tok = entries[p], ref[p - 1], prompt[p]
        assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= k + 1
        assert [entry[t].rank for t in top] == list(range(1, k + 1))
        assert all(e.decoded_token is not None for e in entry.values())


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models("llama")


def test_prompt_logprobs_match_transformers(tiny):
    folder, hf = tiny
    llm = LLM(folder, dtype="float32", max_model_len=128)
    params = [
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3),
        SamplingParams(temperature=0, max_tokens=3),  # in the same batch, asking for none
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0),
    ]
    prompts = [PROMPT, PROMPT[:7], PROMPT[:1]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _check(outs[0].prompt_logprobs, hf, PROMPT, 3)
    assert outs[1].prompt_logprobs is None
    assert outs[2].prompt_logprobs == [None]  # one token: nothing predicts it
    # Asking for them changes nothing else.
    plain = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=3))
    assert outs[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_chunked_prefill_and_preemption_record_each_token_once(tiny):
    folder, hf = tiny
    # Prefill in chunks of 6 tokens, and a KV cache of 5 blocks of 8 (40 tokens) for 3 requests
    # of 20 + 12 tokens: some are preempted and their prompts recomputed.
    llm = LLM(folder, dtype="float32", max_model_len=64, max_num_batched_tokens=6, max_num_seqs=4,
              block_size=8, kv_cache_memory_bytes=5 * 8 * 2 * 2 * 16 * 2 * 4)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 3, params)
    assert llm.engine.stats.preemptions > 0
    for out in outs:
        _check(out.prompt_logprobs, hf, PROMPT, 2)


@pytest.mark.parametrize(
    ("value", "message"),
    [(-1, "prompt_logprobs must be >= 0"), ("3", "prompt_logprobs must be an integer")],
)
def test_bad_prompt_logprobs_are_named(value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(prompt_logprobs=value)


def test_too_many_prompt_logprobs_are_refused_before_any_work(tiny):
    folder, _ = tiny
    llm = LLM(folder, dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="prompt_logprobs=21: at most 20"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(prompt_logprobs=21))
    assert not llm.engine.has_unfinished_requests()
