"""Engines over the shared tiny checkpoints (``tiny_models``, tests/conftest.py) for the pooling
tests, built once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llm(tiny_models):
    """The tiny llama on llmhal, fp32, with a 16-token step budget so a long prompt is prefilled
    in several chunks: (LLM, transformers model)."""
    from llmhal import LLM

    folder, hf = tiny_models("llama")
    llm = LLM(folder, dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=16)  # fmt: skip
    return llm, hf


@pytest.fixture(scope="session")
def hf_pooled():
    """transformers' final hidden states (after the final norm, before the LM head) pooled as
    llmhal pools them: the reference."""
    import torch

    def pool(hf, token_ids: list[int], kind: str, normalize: bool, dims: int | None = None):
        with torch.no_grad():
            out = hf(torch.tensor([token_ids]), output_hidden_states=True)
        h = out.hidden_states[-1][0].float()
        ref = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0], "ALL": h}[kind]
        if dims is not None:
            ref = ref[..., :dims]
        return torch.nn.functional.normalize(ref, dim=-1) if normalize else ref

    return pool
