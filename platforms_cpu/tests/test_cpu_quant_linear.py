"""The CPU quant_linear kernel's int4pack fallback (bf16 activations) against the exact grouped weight.

(It runs when the native quant_gemm kernel cannot be built; test_cpu_quant_gemm.py covers that
kernel and the dispatch between them.)

Tolerance: the kernel rounds activations, scales/zeros and its output to bf16, so its error is
compared with that of a "perfect bf16 kernel" (exact weight, activation and output rounded to
bf16) on the same data: it must stay within 2x of it, and within 1% relative error overall.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from llmhal.ops.quant_linear import GroupedQuantWeight, NativeQuantLinear
from llmhal_cpu.kernels.int4pack import Int4PackLinear

pytestmark = pytest.mark.skipif(
    Int4PackLinear.supports(
        GroupedQuantWeight(torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 1), None, 32, 4),
        torch.float32,
    )
    is not None,
    reason="this torch has no int4pack CPU kernel",
)


AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def make_weight(n, k, g, bits, offset=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    # fp16-representable scales, as GGUF stores them
    scale = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001).half().float()
    off = (torch.randn(n, k // g, generator=gen) * 0.05).half().float() if offset else None
    return GroupedQuantWeight(q, scale, off, g, bits)


def rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize(
    "bits,g,offset", [(4, 32, True), (4, 32, False), (4, 64, True), (4, 256, True), (8, 32, False), (8, 32, True)]
)  # fmt: skip
def test_matches_exact_weight_within_bf16_error(bits, g, offset):
    n, k = 96, 512
    w = make_weight(n, k, g, bits, offset, seed=bits + g)
    kernel = Int4PackLinear(w, torch.float32)
    if bits == 4 or AVX512:
        assert kernel.name == "cpu_int4pack"
    else:
        assert kernel.name.startswith("native (8-bit codes")
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1))
    wd = w.dequantize().double()
    ref = x.double() @ wd.T
    ideal = (x.bfloat16().double() @ wd.T).bfloat16()  # a perfect bf16 kernel
    y = kernel(x)
    assert y.dtype == torch.float32 and y.shape == (7, n)
    assert rel(y, ref) < 1e-2
    assert rel(y, ref) < 2 * rel(ideal, ref) + 1e-4


def test_batch_shapes_bias_and_dtypes():
    w = make_weight(64, 128, 32, 4)
    kernel = Int4PackLinear(w, torch.bfloat16)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(64, generator=torch.Generator().manual_seed(3))
    ref = x.double() @ w.dequantize().double().T + bias.double()
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        y = kernel(x.to(dt), bias)
        assert y.dtype == dt and y.shape == (2, 3, 64)
        assert rel(y, ref) < 1e-2


def test_large_n_is_packed_in_chunks():
    # N above the repacking chunk (4096 rows) and a multiple of 64: chunks must join seamlessly.
    w = make_weight(4096 + 64, 64, 32, 8, seed=5)
    kernel = Int4PackLinear(w, torch.float32)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    assert rel(kernel(x), x.double() @ w.dequantize().double().T) < 1e-2


def test_dequantize_and_weight_bytes():
    w = make_weight(32, 256, 32, 4)
    kernel = Int4PackLinear(w, torch.float32)
    torch.testing.assert_close(kernel.dequantize(), w.dequantize(), rtol=1e-2, atol=1e-3)
    # 4-bit codes plus bf16 (scale, zero) per group of 32: 5 bits per weight, like Q4_1
    assert kernel.weight_bytes() == 32 * 256 // 2 + 32 * 8 * 2 * 2
    if AVX512:
        w8 = make_weight(32, 256, 32, 8)
        # two 4-bit planes plus two bf16 (scale, zero) pairs per group
        assert Int4PackLinear(w8, torch.float32).weight_bytes() == 32 * 256 + 32 * 16 * 2 * 2


@pytest.mark.parametrize(
    "n,k,g,reason",
    [(64, 64, 16, "group size 16"), (40, 64, 32, "N=40 is not a multiple of 16")],
)
def test_unsupported_weights_are_delegated_to_native(n, k, g, reason):
    w = make_weight(n, k, g, 4)
    assert reason in Int4PackLinear.supports(w, torch.float32)
    kernel = Int4PackLinear(w, torch.float32)
    assert kernel.name.startswith("native") and reason in kernel.name
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6))
    native = NativeQuantLinear(w, torch.float32)
    assert torch.equal(kernel(x), native(x))
    assert kernel.weight_bytes() == native.weight_bytes()
    ids = torch.tensor([[1, 0], [n - 1, 1]])
    assert torch.equal(kernel.embedding(ids), native.embedding(ids))
    # the int4pack layout is not row-addressable: no lookups offered
    assert not hasattr(Int4PackLinear(make_weight(64, 64, 32, 4), torch.float32), "embedding")


def test_avx2_only_cpu():
    """The kernel must not assume AVX-512: run it with torch restricted to AVX2 (4-bit weights run
    int4pack there; 8-bit ones are delegated to the native kernel)."""
    code = textwrap.dedent(
        """
        import torch
        from llmhal.ops.quant_linear import GroupedQuantWeight
        from llmhal_cpu.kernels.int4pack import Int4PackLinear
        assert torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT", "NO AVX"), torch.backends.cpu.get_cpu_capability()
        g = torch.Generator().manual_seed(0)
        for bits in (4, 8):
            q = torch.randint(0, 16, (64, 128), generator=g, dtype=torch.uint8) if bits == 4 else torch.randint(-128, 128, (64, 128), generator=g).to(torch.int8)
            w = GroupedQuantWeight(q, torch.rand(64, 4, generator=g) * 0.02, torch.randn(64, 4, generator=g) * 0.05, 32, bits)
            x = torch.randn(5, 128, generator=g)
            ref = x.double() @ w.dequantize().double().T
            kernel = Int4PackLinear(w, torch.float32)
            assert (kernel.name == "cpu_int4pack") == (bits == 4), kernel.name
            err = float((kernel(x).double() - ref).norm() / ref.norm())
            assert err < 1e-2, (bits, err)
        print("ok")
        """
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ok" in out.stdout
