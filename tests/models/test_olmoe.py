"""OLMoE's own structure on a tiny random checkpoint: whole-width q/k norms loaded from HF, the
``clip_qkv`` clamp kept, tensor parallelism refused by name. Its parity with HF transformers runs
with the other MoE models in tests/models/test_moe_parity.py."""

from __future__ import annotations

import pytest
import torch

from llmhal.testing.model_parity import build_model, save_tiny_model, tiny_config

# 0.5 is below most normed q/k values, so the clamp is live (parity of this case and one without
# renormalization or clamp: tests/models/test_moe_parity.py).
CONFIG = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 48,
    "norm_topk_prob": True,
    "clip_qkv": 0.5,
    "initializer_range": 0.1,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("olmoe")
    return save_tiny_model(tiny_config("OlmoeForCausalLM", **CONFIG), folder), folder


def test_norms_span_every_head(checkpoint):
    hf, folder = checkpoint
    model, _ = build_model(folder)
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (64,) and attn.k_norm.weight.shape == (32,)
    assert torch.equal(attn.q_norm.weight, hf.model.layers[0].self_attn.q_norm.weight)
    assert attn.clip_qkv == 0.5


def test_tensor_parallelism_is_refused_by_name(checkpoint, monkeypatch):
    """The whole-width q/k norms need every head on one rank: a TP rank's share is refused."""
    import llmhal.layers.linear as linear

    _, folder = checkpoint
    monkeypatch.setattr(linear, "tp_rank_and_size", lambda: (0, 2))
    with pytest.raises(NotImplementedError, match="tensor_parallel_size=1"):
        build_model(folder)
