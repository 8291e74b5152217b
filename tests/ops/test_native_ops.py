"""The native op definitions and the layers built on them, against HF transformers' own modules."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from llmhal.layers.rotary_embedding import (
    compute_inv_freq,
    get_rope,
    get_rope_from_hf_config,
    rope_parameters,
)
from llmhal.ops import native
from llmhal.ops.registry import _reset_for_tests, register_op_kernel

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_hf_bitwise(dtype):
    torch.manual_seed(0)
    hf = LlamaRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96))
    hf = hf.to(dtype)
    x = (torch.randn(7, 96) * 3).to(dtype)
    assert torch.equal(native.rms_norm(x, hf.weight.data, 1e-5), hf(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_is_add_then_norm(dtype):
    torch.manual_seed(1)
    x, res = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    w = torch.randn(64, dtype=dtype)
    x0, r0 = x.clone(), res.clone()
    normed, summed = native.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(summed, x0 + r0)
    assert torch.equal(normed, native.rms_norm(x0 + r0, w, 1e-6))
    assert torch.equal(x, x0) and torch.equal(res, r0), "inputs must not be modified"


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_hf_mlp_gate(dtype):
    torch.manual_seed(2)
    x = torch.randn(3, 2 * 40, dtype=dtype)
    expected = ACT2FN["silu"](x[:, :40]) * x[:, 40:]
    assert torch.equal(native.silu_and_mul(x), expected)


def _llama_config(head_dim: int, rope: dict, max_pos: int = 512) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=dict(rope),
    )


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(ROPES))
def test_rotary_matches_hf(kind, dtype):
    """Queries/keys rotated by our op equal HF's apply_rotary_pos_emb (HF rotates in the activation
    dtype with cos/sin rounded to it, as our cache does)."""
    torch.manual_seed(3)
    d, t = 64, 37
    cfg = _llama_config(d, ROPES[kind])
    hf_rope = LlamaRotaryEmbedding(cfg)
    positions = torch.randint(0, 500, (t,))
    q = torch.randn(t, 4 * d).to(dtype)
    k = torch.randn(t, 2 * d).to(dtype)
    cos, sin = hf_rope(q, positions[None])
    hq, hk = apply_rotary_pos_emb(
        q.view(1, t, 4, d).transpose(1, 2), k.view(1, t, 2, d).transpose(1, 2), cos, sin
    )
    rope = get_rope_from_hf_config(cfg, d, dtype=dtype)
    hq = hq.transpose(1, 2).reshape(t, -1)
    hk = hk.transpose(1, 2).reshape(t, -1)
    # Same float32 angles, same rounding of cos/sin, same arithmetic: bit-identical, both for the
    # native definition and for whatever kernel the layer dispatches to on this platform.
    nq, nk = native.rotary_embedding(positions, q, k, rope.cos_sin_cache, d, True)
    assert torch.equal(nq, hq) and torch.equal(nk, hk)
    oq, ok = rope(positions, q.clone(), k.clone())
    assert torch.equal(oq, hq) and torch.equal(ok, hk)


@pytest.mark.parametrize("kind", ["linear", "llama3", "yarn"])
def test_inv_freq_equals_hf_init_functions(kind):
    cfg = _llama_config(64, ROPES[kind])
    expected, scale = ROPE_INIT_FUNCTIONS[kind](cfg, None)
    got, our_scale = compute_inv_freq(rope_parameters(cfg), 64, 512, 512)
    torch.testing.assert_close(got, expected, atol=0, rtol=1e-6)
    assert our_scale == pytest.approx(scale)


def test_dynamic_ntk_static_table():
    """Within the original context the table is HF's unscaled one; served beyond it, the base is
    the one HF computes for a sequence of the served length."""
    cfg = _llama_config(64, ROPES["dynamic"], max_pos=128)
    params = rope_parameters(cfg)
    within, _ = compute_inv_freq(params, 64, 128, 128)
    torch.testing.assert_close(within, 1.0 / (10000.0 ** (torch.arange(0, 64, 2) / 64)))
    beyond, _ = compute_inv_freq(params, 64, 512, 128)
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, None, seq_len=512)
    torch.testing.assert_close(beyond, expected, atol=0, rtol=1e-6)


def _complex_rotation(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, d: int):
    """GPT-J rotation written as a complex product: pairs (2i, 2i+1) times exp(i * pos * f_i)."""
    t = x.shape[0]
    xc = torch.view_as_complex(x.double().view(t, -1, d // 2, 2).contiguous())
    angle = pos.double()[:, None] * inv_freq.double()[None]
    out = xc * torch.polar(torch.ones_like(angle), angle)[:, None]
    return torch.view_as_real(out).reshape(t, -1).float()


def test_rotary_interleaved_and_partial_against_complex_product():
    torch.manual_seed(4)
    d, t = 32, 11
    pos = torch.randint(0, 60, (t,))
    q, k = torch.randn(t, 3 * d), torch.randn(t, d)
    rope = get_rope(d, d, 64, is_neox_style=False, dtype=torch.float32)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    oq, ok = rope(pos, q.clone(), k.clone())
    torch.testing.assert_close(oq, _complex_rotation(q, pos, inv, d), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ok, _complex_rotation(k, pos, inv, d), atol=1e-5, rtol=1e-5)
    # Partial rotary (neox): only the first rotary_dim features of each head move.
    rot = 16
    part = get_rope(d, rot, 64, dtype=torch.float32)
    pq, _ = part(pos, q.clone(), k.clone())
    qh, ph = q.view(t, 3, d), pq.view(t, 3, d)
    assert torch.equal(ph[..., rot:], qh[..., rot:])
    inv_r = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    cos, sin = (pos[:, None] * inv_r).cos()[:, None], (pos[:, None] * inv_r).sin()[:, None]
    x1, x2 = qh[..., : rot // 2], qh[..., rot // 2 : rot]
    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    torch.testing.assert_close(ph[..., :rot], expected, atol=1e-5, rtol=1e-5)


def test_rope_parameters_reads_both_config_styles():
    v4 = SimpleNamespace(
        rope_theta=5e5,
        rope_scaling={"type": "linear", "factor": 2.0},
        max_position_embeddings=64,
    )
    p = rope_parameters(v4)
    assert (p["rope_type"], p["rope_theta"], p["factor"]) == ("linear", 5e5, 2.0)
    v5 = SimpleNamespace(
        rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0},
        max_position_embeddings=64,
    )
    assert rope_parameters(v5)["rope_type"] == "llama3"
    bare = SimpleNamespace(max_position_embeddings=64)
    assert rope_parameters(bare) == {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 1.0,
    }


def test_unsupported_rope_type_names_the_supported_ones():
    cfg = SimpleNamespace(rope_scaling={"type": "su"}, max_position_embeddings=16)
    with pytest.raises(ValueError, match=r"'longrope' is not supported; supported: default"):
        get_rope_from_hf_config(cfg, 64, dtype=torch.float32)


def test_layers_dispatch_each_op_once_through_the_registry():
    """A kernel registered for an op is what the layers call (resolved at construction)."""
    from llmhal.layers.activation import SiluAndMul
    from llmhal.layers.layernorm import RMSNorm

    calls = []

    def spy_rms_norm(x, weight, eps):
        calls.append("rms_norm")
        return native.rms_norm(x, weight, eps)

    import sys

    module = type(sys)("llmhal_test_spy_ops")
    module.rms_norm = spy_rms_norm
    sys.modules[module.__name__] = module
    try:
        register_op_kernel("rms_norm", f"{module.__name__}:rms_norm")
        norm = RMSNorm(8, eps=1e-6, params_dtype=torch.float32)
        x = torch.randn(2, 8)
        assert torch.equal(norm(x), native.rms_norm(x, norm.weight, 1e-6))
        assert calls == ["rms_norm"]
        torch.testing.assert_close(
            SiluAndMul()(torch.ones(1, 4)), torch.full((1, 2), 0.7311), atol=1e-4, rtol=0
        )
    finally:
        _reset_for_tests()
        del sys.modules[module.__name__]


def test_rotary_cache_holds_cos_then_sin_in_model_dtype():
    rope = get_rope(8, 8, 10, dtype=torch.bfloat16)
    assert rope.cos_sin_cache.shape == (10, 8) and rope.cos_sin_cache.dtype == torch.bfloat16
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    assert rope.cos_sin_cache[3, 0].item() == pytest.approx(math.cos(3 * inv[0]), abs=1e-2)
    assert rope.cos_sin_cache[3, 4].item() == pytest.approx(math.sin(3 * inv[0]), abs=1e-2)
