"""MiniMax-Text-01 (lightning attention + softmax attention, MoE MLP) through the engine against
transformers on a tiny random checkpoint (fp32): 64 greedy steps of a batch of prompts of
different lengths (the longest crosses a 16-token lightning block), prefill chunked and not,
across preemptions; its lightning layers served by linear_attn."""

from __future__ import annotations

import pytest
import torch

from llmhal import LLM
from llmhal.testing.engine_parity import (
    PROMPTS,
    compare_with_references,
    hf_references,
    preempting_budget,
)

STEPS = 64


@pytest.fixture(scope="module")
def minimax(tiny_models):
    folder, hf = tiny_models("minimax")
    return folder, hf_references(hf, PROMPTS, STEPS)


@pytest.fixture(scope="module")
def chunked_llm(minimax):
    # 8 tokens a step: the 29-token prompt is prefilled in chunks that continue a carried state.
    kw = dict(max_num_seqs=4, max_num_batched_tokens=8, enforce_eager=True)
    return LLM(minimax[0], dtype="float32", **kw)


def test_matches_transformers_with_chunked_prefill(minimax, chunked_llm):
    assert compare_with_references(chunked_llm, minimax[1]) == []


def test_matches_transformers_unchunked_across_preemption(minimax, chunked_llm):
    budget = preempting_budget(chunked_llm, slots=4, blocks=7)
    llm = LLM(minimax[0], dtype="float32", max_num_seqs=4, kv_cache_memory_bytes=budget)
    assert compare_with_references(llm, minimax[1]) == []
    assert llm.engine.stats.preemptions > 0


def test_lightning_layers_use_linear_attn(chunked_llm):
    runner = chunked_llm.engine.runner
    assert [m.kind for m in runner.state_layers] == ["linear", "linear"]
    assert "linear_attn" in runner.attention_backends and len(runner.layers) == 1
    (spec,) = runner.state_layers[0].state_specs()
    assert spec.shape == (4, 16, 16) and spec.dtype == torch.float32
    # The decay rates follow the depth (the last layer nearly none), as the checkpoint's buffers.
    first, last = (m.decay for m in runner.state_layers)
    assert torch.all(last < first * 1e-3)
