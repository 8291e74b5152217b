"""CPU step graphs (``llmhal_cpu.step_graph``): what a capture records, what it refuses, and that a
replay recomputes from the inputs' new values exactly as the eager calls would."""

from __future__ import annotations

import pytest
import torch

from llmhal.ops import native
from llmhal.ops.quant_linear import GroupedQuantWeight
from llmhal_cpu import ops, step_graph
from llmhal_cpu.kernels import fused_ops, quant_gemm

needs_kernels = pytest.mark.skipif(
    fused_ops.load_library() is None
    or quant_gemm.load_library() is None
    or step_graph.LIBRARY.get() is None,
    reason="the native kernels are unavailable (no compiler?)",
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _block(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, gemm: quant_gemm.QuantGemm):
    """A small decoder-like chain of native calls: add+norm, a quantized matmul, SiLU-and-mul."""
    normed, summed = ops.fused_add_rms_norm(x, res, w, 1e-5)
    return ops.silu_and_mul(gemm(normed, mode=quant_gemm.MODE_INT16)), summed


def _weight(n: int, k: int, seed: int) -> GroupedQuantWeight:
    g = _gen(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g).half().float() * 0.1
    offset = -8 * scale
    return GroupedQuantWeight(q, scale, offset, 32, 4)


@needs_kernels
def test_replay_recomputes_from_new_inputs():
    g = _gen(0)
    x, res = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    w = torch.randn(64, generator=g)
    gemm = quant_gemm.QuantGemm(_weight(96, 64, 1), quant_gemm.load_library())
    (out, summed), graph, reason = step_graph.capture(lambda: _block(x, res, w, gemm))
    assert reason is None and graph is not None
    assert graph.num_calls == 3
    first = out.clone()
    for seed in (2, 3):
        x.copy_(torch.randn(3, 64, generator=_gen(seed)))
        res.copy_(torch.randn(3, 64, generator=_gen(seed + 10)))
        graph.replay()
        want, want_sum = _block(x, res, w, gemm)
        assert torch.equal(out, want) and torch.equal(summed, want_sum)
        assert not torch.equal(out, first)


@needs_kernels
def test_rotary_replay_rejects_a_position_past_the_table():
    g = _gen(4)
    q, k = torch.randn(2, 64, generator=g), torch.randn(2, 32, generator=g)
    cache = torch.randn(16, 32, generator=g)
    pos = torch.tensor([3, 7])
    _, graph, reason = step_graph.capture(lambda: ops.rotary_embedding(pos, q, k, cache, 32, True))
    assert reason is None and graph is not None
    pos[1] = 16
    with pytest.raises(RuntimeError, match="llmhal_rotary_call"):
        graph.replay()


@needs_kernels
def test_a_torch_op_refuses_the_capture_and_keeps_the_result():
    x = torch.randn(4, 8, generator=_gen(5))
    w = torch.ones(8)

    def step():
        return ops.rms_norm(x, w, 1e-6) * 2  # the multiply would not be replayed

    out, graph, reason = step_graph.capture(step)
    assert graph is None and "mul" in reason
    torch.testing.assert_close(out, native.rms_norm(x, w, 1e-6) * 2, atol=1e-6, rtol=1e-6)


@needs_kernels
def test_views_and_reshapes_are_allowed_but_copies_are_not():
    x = torch.randn(2, 3, 8, generator=_gen(6))
    w = torch.ones(8)
    out, graph, reason = step_graph.capture(lambda: ops.rms_norm(x.reshape(6, 8), w, 1e-6))
    assert reason is None and graph is not None
    t = x.transpose(0, 1)  # reshaping this one copies
    out, graph, reason = step_graph.capture(lambda: ops.rms_norm(t.reshape(6, 8), w, 1e-6))
    assert graph is None and "reshape" in reason


def test_nothing_recorded_and_no_nesting():
    _, graph, reason = step_graph.capture(lambda: 1)
    assert graph is None and "no native kernel calls" in reason

    def nested():
        return step_graph.capture(lambda: 0)

    with pytest.raises(RuntimeError, match="already being captured"):
        step_graph.capture(nested)
    # the failed nesting left no recording behind
    _, graph, reason = step_graph.capture(lambda: 1)
    assert "no native kernel calls" in reason


def _norm_chain(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = ops.rms_norm(x, w, 1e-6)
    return x


@needs_kernels
def test_buffers_are_reused_within_a_step_and_across_graphs():
    w = torch.randn(64, generator=_gen(7))
    big, small = torch.randn(8, 64, generator=_gen(8)), torch.randn(2, 64, generator=_gen(9))
    out_big, g_big, _ = step_graph.capture(lambda: _norm_chain(big, w, 6))
    # Six calls, but each intermediate dies once the next is computed: the chain ping-pongs.
    assert g_big.num_calls == 6 and len(g_big.pool._storages) <= 3
    before = g_big.pool.nbytes
    out_small, g_small, _ = step_graph.capture(lambda: _norm_chain(small, w, 6), g_big.pool)
    assert g_small.pool is g_big.pool
    # The big step's free buffer (all but its output) serves the small one: it adds one buffer
    # where it needs two at a time.
    assert g_big.pool.nbytes == before + small.numel() * 4
    for seed in (10, 11):  # graphs sharing a pool, replayed in turn, each reading its own input
        big.copy_(torch.randn(8, 64, generator=_gen(seed)))
        small.copy_(torch.randn(2, 64, generator=_gen(seed + 5)))
        g_big.replay()
        assert torch.equal(out_big, _norm_chain(big, w, 6))
        g_small.replay()
        assert torch.equal(out_small, _norm_chain(small, w, 6))
