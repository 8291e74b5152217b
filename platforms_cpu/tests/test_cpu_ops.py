"""The CPU op kernels against the native definitions (``llmhal.ops.native``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from llmhal.ops import native
from llmhal_cpu import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (atol, rtol): float32 differs at most by reduction order; 16-bit by one rounding step.
TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    atol, rtol = TOL[a.dtype]
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def test_cpu_platform_registers_the_kernels():
    from llmhal_cpu.platform import CpuPlatform

    for op in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"):
        assert CpuPlatform.op_kernels[op] == f"llmhal_cpu.ops:{op}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 17])
def test_norms_match_native(dtype, tokens):
    torch.manual_seed(0)
    x = (torch.randn(tokens, 576) * 2).to(dtype)
    res = torch.randn(tokens, 576).to(dtype)
    w = torch.randn(576).to(dtype)
    _close(ops.rms_norm(x, w, 1e-5), native.rms_norm(x, w, 1e-5))
    n1, s1 = ops.fused_add_rms_norm(x, res, w, 1e-5)
    n2, s2 = native.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(s1, s2)
    _close(n1, n2)
    # 3-D input (per-head norms, Qwen3) and a float32 weight on 16-bit activations.
    xh = x.view(tokens, 9, 64)
    _close(ops.rms_norm(xh, w[:64].float(), 1e-6), native.rms_norm(xh, w[:64].float(), 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_native(dtype):
    torch.manual_seed(1)
    x = torch.randn(5, 2 * 96).to(dtype)
    _close(ops.silu_and_mul(x), native.silu_and_mul(x))


def _table(max_pos: int, rot: int, dtype: torch.dtype) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    f = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat((f.cos(), f.sin()), -1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot", [64, 32])
@pytest.mark.parametrize("layout", ["fused_qkv", "separate"])
def test_rotary_matches_native(dtype, is_neox, rot, layout):
    torch.manual_seed(2)
    t, h, hkv, d = 13, 9, 3, 64
    qkv = torch.randn(t, (h + 2 * hkv) * d).to(dtype)
    positions = torch.randint(0, 300, (t,))
    cache = _table(300, rot, dtype)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    eq, ek = native.rotary_embedding(positions, q, k, cache, d, is_neox)
    v_before = v.clone()
    if layout == "separate":
        q, k = q.clone(), k.clone()
    oq, ok = ops.rotary_embedding(positions, q, k, cache, d, is_neox)
    # Same element-wise arithmetic in the same dtype: bit-identical.
    assert torch.equal(oq, eq) and torch.equal(ok, ek)
    assert torch.equal(v, v_before), "the value part of the fused projection must not change"


def test_rotary_handles_non_contiguous_inputs():
    torch.manual_seed(3)
    t, d = 6, 32
    base = torch.randn(2 * t, 4 * d)
    q = base[::2]  # rows with a stride: not a view the joint path can use
    k = torch.randn(t, 2 * d)
    positions = torch.arange(t)
    cache = _table(16, d, torch.float32)
    eq, ek = native.rotary_embedding(positions, q, k, cache, d, True)
    oq, ok = ops.rotary_embedding(positions, q, k, cache, d, True)
    assert torch.equal(oq, eq) and torch.equal(ok, ek)


_SUBPROCESS_CHECK = textwrap.dedent(
    """
    import torch
    from llmhal.ops import native
    from llmhal_cpu import ops
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, 576).to(dtype); w = torch.randn(576).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), native.rms_norm(x, w, 1e-5), atol=tol, rtol=tol)
        n1, _ = ops.fused_add_rms_norm(x, x, w, 1e-5); n2, _ = native.fused_add_rms_norm(x, x, w, 1e-5)
        torch.testing.assert_close(n1, n2, atol=tol, rtol=tol)
        g = torch.randn(7, 256).to(dtype)
        torch.testing.assert_close(ops.silu_and_mul(g), native.silu_and_mul(g), atol=tol, rtol=tol)
        qkv = torch.randn(7, 15 * 64).to(dtype)
        q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], -1)
        cache = torch.randn(64, 64).to(dtype); pos = torch.arange(7) * 3
        eq, ek = native.rotary_embedding(pos, q, k, cache, 64, True)
        oq, ok = ops.rotary_embedding(pos, q, k, cache, 64, True)
        torch.testing.assert_close(oq, eq, atol=tol, rtol=tol); torch.testing.assert_close(ok, ek, atol=tol, rtol=tol)
    print("OK", "eager" if ops.rms_norm is ops._rms_norm else "compiled")
    """
)


def _run(env_extra: dict[str, str]) -> str:
    env = {**os.environ, **env_extra}
    proc = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS_CHECK],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_kernels_match_native_with_avx2_only_torch_kernels():
    """The kernels assume no ISA; torch's own kernels restricted to AVX2 give the same values."""
    assert _run({"ATEN_CPU_CAPABILITY": "avx2"}).split() == ["OK", "eager"]


@pytest.mark.slow
def test_compiled_kernels_match_native():
    """``LLMHAL_CPU_COMPILE=1`` swaps in torch.compile'd native definitions (seconds per op)."""
    assert _run({"LLMHAL_CPU_COMPILE": "1"}).split() == ["OK", "compiled"]
