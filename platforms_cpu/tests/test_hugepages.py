"""The huge-page arena that holds the CPU kernels' packed weights."""

from __future__ import annotations

import sys

import pytest
import torch

from llmhal_cpu import hugepages
from llmhal_cpu.hugepages import HUGE_PAGE, HugePageArena


def test_pieces_are_aligned_disjoint_and_keep_their_values():
    arena = HugePageArena(slab_bytes=4 * HUGE_PAGE)
    sizes = [1, 63, 64, 1000, 3 << 20, 5 << 20]  # the last one gets a slab of its own
    pieces = []
    for i, n in enumerate(sizes):
        p = arena.empty(n)
        assert p.dtype == torch.uint8 and p.numel() == n and p.data_ptr() % 64 == 0
        p.fill_(i + 1)
        pieces.append(p)
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel()) for p in pieces)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    assert [int(p[0]) for p in pieces] == [i + 1 for i in range(len(sizes))]
    assert all(bool(p.eq(i + 1).all()) for i, p in enumerate(pieces))
    assert pieces[-1].untyped_storage().nbytes() >= 5 << 20  # a slab of its own
    assert pieces[-1].untyped_storage().data_ptr() != pieces[0].untyped_storage().data_ptr()


def test_place_copies_dtype_shape_and_values_from_a_strided_tensor():
    arena = HugePageArena()
    t = torch.arange(24, dtype=torch.float16).view(2, 3, 4).permute(2, 0, 1)
    out = arena.place(t)
    assert out.is_contiguous() and out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(out, t)


def test_slabs_are_huge_page_aligned_and_advised_on_linux(monkeypatch):
    arena = HugePageArena(slab_bytes=2 * HUGE_PAGE)
    p = arena.empty(100)
    assert p.untyped_storage().data_ptr() % 64 == 0
    assert p.data_ptr() % HUGE_PAGE == 0  # the first piece starts its slab
    if sys.platform.startswith("linux"):
        assert arena.advised == 2 * HUGE_PAGE
    # Without madvise (another OS, THP off) the memory is ordinary and still works.
    monkeypatch.setattr(hugepages, "_madvise_hugepage", lambda addr, n: False)
    plain = HugePageArena(slab_bytes=2 * HUGE_PAGE)
    q = plain.empty(10)
    q.fill_(7)
    assert plain.advised == 0 and int(q.sum()) == 70


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_weights_live_in_the_arena(bits):
    from llmhal.ops.quant_linear import GroupedQuantWeight
    from llmhal_cpu.kernels import quant_gemm

    lib = quant_gemm.load_library()
    if lib is None:
        pytest.skip(f"quant_gemm unavailable: {quant_gemm.kernel_status()}")
    g = torch.Generator().manual_seed(bits)
    n, k, gs = 48, 64, 32
    lo, hi = (0, 16) if bits == 4 else (-128, 128)
    w = GroupedQuantWeight(
        qweight=torch.randint(lo, hi, (n, k), generator=g).to(
            torch.int8 if bits == 8 else torch.uint8
        ),
        scale=torch.rand(n, k // gs, generator=g) * 0.1,
        offset=None,
        bits=bits,
        group_size=gs,
    )
    qg = quant_gemm.QuantGemm(w, lib)
    for t in (qg.packed, qg.scales):  # pieces of a slab, not tensors of their own
        assert t.untyped_storage().nbytes() >= hugepages.SLAB_BYTES and t.data_ptr() % 64 == 0
    x = torch.randn(3, k, generator=g)
    want = x @ w.dequantize().T
    torch.testing.assert_close(qg(x, mode=quant_gemm.MODE_FP32), want, rtol=1e-5, atol=1e-5)
