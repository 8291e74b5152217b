"""Bamba (Mamba-2 layers + attention layers) through the engine against transformers on a tiny
random checkpoint (fp32): 64 greedy steps of a batch of prompts of different lengths (the longest
crosses a 16-token SSD chunk), prefill chunked and not, across preemptions. Its attention layer
holds KV blocks and its Mamba layers one state slot per request, both from one budget."""

from __future__ import annotations

import pytest

from llmhal import LLM
from llmhal.testing.engine_parity import (
    PROMPTS,
    compare_with_references,
    hf_references,
    preempting_budget,
)

STEPS = 64


@pytest.fixture(scope="module")
def bamba(tiny_models):
    folder, hf = tiny_models("bamba")
    return folder, hf_references(hf, PROMPTS, STEPS)


@pytest.fixture(scope="module")
def chunked_llm(bamba):
    kw = dict(max_num_seqs=4, max_num_batched_tokens=8, enforce_eager=True)
    return LLM(bamba[0], dtype="float32", **kw)


def test_matches_transformers_with_chunked_prefill(bamba, chunked_llm):
    assert compare_with_references(chunked_llm, bamba[1]) == []


def test_matches_transformers_unchunked_across_preemption(bamba, chunked_llm):
    budget = preempting_budget(chunked_llm, slots=4, blocks=7)
    llm = LLM(bamba[0], dtype="float32", max_num_seqs=4, kv_cache_memory_bytes=budget)
    assert compare_with_references(llm, bamba[1]) == []
    assert llm.engine.stats.preemptions > 0


def test_hybrid_layers_and_backends(chunked_llm):
    runner = chunked_llm.engine.runner
    assert [m.kind for m in runner.state_layers] == ["mamba2", "mamba2"]
    assert len(runner.layers) == 1 and runner.layers[0].backend.kind == "mha"
    assert "mamba2_attn" in runner.attention_backends
    # Half of each 16-dim head is rotated (transformers fixes Bamba's partial_rotary_factor).
    assert runner.model.rotary_emb.rotary_dim == 8
