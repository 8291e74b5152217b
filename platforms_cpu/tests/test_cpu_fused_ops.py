"""The native kernels of the small ops (``kernels/fused_ops.cpp``) against the native definitions,
float32 and bfloat16, on the shapes and layouts the kernels take and the ones they hand back to
torch."""

from __future__ import annotations

import pytest
import torch

from llmhal.ops import native
from llmhal_cpu import ops
from llmhal_cpu.kernels import fused_ops

needs_kernel = pytest.mark.skipif(
    fused_ops.load_library() is None, reason=f"fused_ops unavailable: {fused_ops.status()}"
)
TOL = dict(atol=1e-6, rtol=1e-6)  # a row's sum order, a 1-ulp exp


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@needs_kernel
def test_the_kernels_are_in_use_and_say_so():
    x = torch.randn(3, 40, generator=_gen(0))
    assert fused_ops.rms_norm(x, torch.ones(40), 1e-6) is not None
    assert fused_ops.silu_and_mul(x) is not None
    assert fused_ops.status().startswith("native")
    assert ops.rms_norm.status is fused_ops.status


@needs_kernel
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (17, 576), (5, 37), (300, 576)])
def test_norms_match_native(tokens, hidden):
    g = _gen(tokens)
    x = torch.randn(tokens, hidden, generator=g) * 3
    res = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(hidden, generator=g)
    x0, res0 = x.clone(), res.clone()
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), native.rms_norm(x, w, 1e-5), **TOL)
    normed, summed = ops.fused_add_rms_norm(x, res, w, 1e-5)
    ref_normed, ref_summed = native.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(summed, ref_summed)  # one add per element: exact
    torch.testing.assert_close(normed, ref_normed, **TOL)
    assert torch.equal(x, x0) and torch.equal(res, res0), "inputs must not change"


@needs_kernel
def test_norm_of_rows_with_a_stride():
    base = torch.randn(6, 2 * 64, generator=_gen(1))
    x = base[:, :64]  # every row is contiguous, the rows are 128 apart
    w = torch.randn(64, generator=_gen(2))
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), native.rms_norm(x, w, 1e-6), **TOL)


@needs_kernel
@pytest.mark.parametrize("tokens,d", [(1, 1536), (32, 1536), (3, 13), (64, 1536)])
def test_silu_and_mul_matches_native(tokens, d):
    x = torch.randn(tokens, 2 * d, generator=_gen(d)) * 4
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # saturated exp on either side
    torch.testing.assert_close(ops.silu_and_mul(x), native.silu_and_mul(x), **TOL)


@needs_kernel
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_size,rot", [(64, 64), (80, 32), (18, 6)])
def test_rotary_is_bit_identical_to_native(is_neox, head_size, rot):
    g = _gen(head_size + rot)
    t, h, hkv = 11, 5, 1
    qkv = torch.randn(t, (h + 2 * hkv) * head_size, generator=g)
    q, k, v = qkv.split([h * head_size, hkv * head_size, hkv * head_size], dim=-1)
    positions = torch.randint(0, 40, (t,), generator=g)
    cache = torch.randn(40, rot, generator=g)
    eq, ek = native.rotary_embedding(positions, q, k, cache, head_size, is_neox)
    v0 = v.clone()
    assert fused_ops.rotary_(positions, q, k, cache, head_size, is_neox)
    # The kernel does not fuse multiply-adds here: the same roundings as torch's two-op form.
    assert torch.equal(q, eq) and torch.equal(k, ek)
    assert torch.equal(v, v0)


@needs_kernel
def test_rotary_position_out_of_range_changes_nothing_and_torch_raises():
    q = torch.randn(2, 64, generator=_gen(3))
    k = torch.randn(2, 64, generator=_gen(4))
    q0, k0 = q.clone(), k.clone()
    cache = torch.randn(8, 64, generator=_gen(5))
    for bad in ([0, 8], [-1, 0]):
        pos = torch.tensor(bad)
        assert not fused_ops.rotary_(pos, q, k, cache, 64, True)
        assert torch.equal(q, q0) and torch.equal(k, k0)
        with pytest.raises(IndexError):
            ops.rotary_embedding(pos, q, k, cache, 64, True)


def test_other_dtypes_and_layouts_go_to_torch():
    x16 = torch.randn(4, 32).half()
    assert fused_ops.rms_norm(x16, torch.ones(32).half(), 1e-6) is None
    assert fused_ops.silu_and_mul(x16) is None
    # float32 activations with a bf16 weight: torch's promotion decides the result's dtype.
    assert fused_ops.rms_norm(torch.randn(4, 32), torch.ones(32).bfloat16(), 1e-6) is None
    x3 = torch.randn(2, 32, 3).transpose(1, 2)  # rows with a stride: not contiguous
    assert fused_ops.rms_norm(x3, torch.ones(32), 1e-6) is None
    assert fused_ops.rms_norm(torch.randn(2, 3, 4, 32), torch.ones(32), 1e-6) is None
    xt = torch.randn(32, 4).t()  # columns, not rows
    assert fused_ops.silu_and_mul(xt) is None
    torch.testing.assert_close(ops.silu_and_mul(xt), native.silu_and_mul(xt), **TOL)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("LLMHAL_CPU_OPS_KERNEL", "0")
    assert fused_ops.load_library() is None
    assert fused_ops.status() == "torch (LLMHAL_CPU_OPS_KERNEL=0)"


def test_without_a_compiler_the_reason_is_reported(monkeypatch):
    monkeypatch.setattr(fused_ops.LIBRARY, "compiler", lambda: None)
    monkeypatch.setattr(fused_ops.LIBRARY, "lib", None)
    monkeypatch.setattr(fused_ops.LIBRARY, "status", None)
    assert fused_ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6) is None
    assert "no C++ compiler" in fused_ops.status()
    x = torch.randn(2, 8, generator=_gen(6))
    torch.testing.assert_close(
        ops.rms_norm(x, torch.ones(8), 1e-6), native.rms_norm(x, torch.ones(8), 1e-6)
    )


@needs_kernel
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (8, 768), (5, 37), (300, 576)])
def test_bf16_norms_round_as_torch_does(tokens, hidden, weight_dtype):
    """bf16 in and out, rounded where torch's bf16 path rounds: the residual sum exactly, the
    normed rows within one bf16 ulp where the row's sum order tips a rounding (rarely)."""
    g = _gen(tokens + hidden)
    x = (torch.randn(tokens, hidden, generator=g) * 3).bfloat16()
    res = torch.randn(tokens, hidden, generator=g).bfloat16()
    w = torch.randn(hidden, generator=g).to(weight_dtype)
    got = ops.rms_norm(x, w, 1e-5)
    want = native.rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16 and fused_ops.rms_norm(x, w, 1e-5) is not None
    bf16_ulp = dict(atol=0, rtol=2**-7)
    torch.testing.assert_close(got, want, **bf16_ulp)
    assert (got != want).float().mean() < 1e-3
    normed, summed = ops.fused_add_rms_norm(x, res, w, 1e-5)
    ref_normed, ref_summed = native.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, **bf16_ulp)


@needs_kernel
@pytest.mark.parametrize("tokens,d", [(1, 1536), (8, 2048), (3, 13)])
def test_bf16_silu_and_mul_rounds_as_torch_does(tokens, d):
    x = (torch.randn(tokens, 2 * d, generator=_gen(d)) * 4).bfloat16()
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    got, want = ops.silu_and_mul(x), native.silu_and_mul(x)
    assert got.dtype == torch.bfloat16 and fused_ops.silu_and_mul(x) is not None
    # silu's exp is 1 ulp off torch's at most: a product rounds differently very rarely. Below
    # -87 the exp saturates: ~1e-37 instead of -0.0 (as in float32).
    torch.testing.assert_close(got, want, atol=1e-30, rtol=2**-7)
    assert (got[:, 1:] != want[:, 1:]).float().mean() < 1e-3  # past the saturated element


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_size,rot", [(64, 64), (80, 32), (18, 6)])
def test_bf16_rotary_is_bit_identical_to_native(is_neox, head_size, rot, cache_dtype):
    g = _gen(head_size + rot)
    pos = torch.randint(0, 50, (7,), generator=g)
    cache = torch.randn(50, rot, generator=g).to(cache_dtype)
    q = torch.randn(7, 4 * head_size, generator=g).bfloat16()
    k = torch.randn(7, 2 * head_size, generator=g).bfloat16()
    want_q, want_k = native.rotary_embedding(pos, q.clone(), k.clone(), cache, head_size, is_neox)
    assert fused_ops.rotary_(pos, q, k, cache, head_size, is_neox)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


@needs_kernel
def test_outputs_are_float32_whatever_torchs_default_dtype():
    x = torch.randn(8, 256, generator=_gen(7))
    w = torch.randn(256, generator=_gen(8))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # empty() would otherwise give the kernel 8-byte slots
    try:
        normed, _ = fused_ops.rms_norm(x, w, 1e-6)
        act = fused_ops.silu_and_mul(x)
    finally:
        torch.set_default_dtype(previous)
    assert normed.dtype == act.dtype == torch.float32
    torch.testing.assert_close(normed, native.rms_norm(x, w, 1e-6), **TOL)
    torch.testing.assert_close(act, native.silu_and_mul(x), **TOL)


@needs_kernel
def test_arguments_the_native_definitions_reject_go_to_torch():
    """Shapes torch refuses are never handed to the kernel (which would read or write past a row)."""
    x = torch.randn(2, 64, generator=_gen(9))
    assert fused_ops.rms_norm(x, torch.ones(32), 1e-6) is None  # weight of the wrong size
    assert fused_ops.silu_and_mul(torch.randn(2, 7)) is None  # odd width
    q, k = torch.randn(2, 64), torch.randn(2, 64)
    q0 = q.clone()
    pos = torch.tensor([0, 1])
    assert not fused_ops.rotary_(pos, q, k, torch.randn(16, 96), 64, True)  # rot > head size
    assert not fused_ops.rotary_(pos, q[:, :60], k, torch.randn(16, 64), 64, True)  # 60 % 64
    assert not fused_ops.rotary_(pos, q, k, torch.randn(16, 7), 64, True)  # odd rotary dim
    assert torch.equal(q, q0)
    meta = torch.empty(2, 64, device="meta")
    assert fused_ops.rms_norm(meta, torch.ones(64), 1e-6) is None
    assert fused_ops.silu_and_mul(meta) is None


@needs_kernel
def test_per_head_norms_on_a_slice_of_the_fused_projection():
    # Qwen3's q/k norms: [tokens, heads, head_size] views of the q/k/v output's first columns.
    qkv = torch.randn(5, 4 * 64 + 2 * 2 * 64, generator=_gen(21))
    q = qkv[:, : 4 * 64].reshape(5, 4, 64)
    w = torch.randn(64, generator=_gen(22))
    assert fused_ops.rms_norm(q, w, 1e-6) is not None  # the kernel takes the view as it is
    got = ops.rms_norm(q, w, 1e-6)
    assert got.shape == (5, 4, 64) and got.is_contiguous()
    torch.testing.assert_close(got, native.rms_norm(q, w, 1e-6), **TOL)
    # a fused add needs whole rows: 3-D inputs with a residual go to torch
    assert fused_ops.rms_norm(q, w, 1e-6, torch.zeros_like(q)) is None
