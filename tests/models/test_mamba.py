"""Mamba-1 and FalconMamba through LLM against transformers on tiny random checkpoints (the
helpers and the engine checks shared with Mamba-2 live in test_mamba2.py); Mamba-1 streamed by
``llmhal serve``."""

from __future__ import annotations

import pytest

from llmhal import LLM
from llmhal.testing.engine_parity import (
    PROMPTS,
    compare_with_references,
    hf_references,
    serve_stream_problems,
)
from tests.models.test_mamba2 import force_preemption


@pytest.mark.parametrize("arch", ["mamba", "falcon_mamba"])
def test_greedy_tokens_and_logprobs_match_transformers(tiny_models, arch):
    folder, model = tiny_models(arch)
    refs = hf_references(model, PROMPTS, 64)
    llm = LLM(folder, dtype="float32", max_num_seqs=4, max_num_batched_tokens=8)
    assert llm.engine.runner.attention_backends == ["mamba1_attn"]
    assert compare_with_references(llm, refs) == []  # chunked prefill, mixed with decodes
    whole = LLM(folder, dtype="float32", max_num_seqs=4, block_size=16)
    force_preemption(whole, num_blocks=9)
    assert compare_with_references(whole, refs) == []  # whole prompts, across preemptions
    assert whole.engine.scheduler.num_preemptions > 0


def test_serve_streams_what_the_offline_api_generates(tiny_models):
    folder, _ = tiny_models("mamba")
    llm = LLM(folder, dtype="float32", max_num_seqs=4, max_num_batched_tokens=8)
    assert serve_stream_problems(llm, folder) == []
