"""The native few-row linear kernel (``kernels/rows_linear.cpp``) and the bf16 ``dense_linear``
kernel built on it: within one output rounding of a float64 product, ``F.linear`` itself beyond
its rows, and recordable as a step graph (what lets a bf16 model's decode steps be recorded)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmhal_cpu.kernels import dense_linear, rows_linear

needs_kernel = pytest.mark.skipif(
    rows_linear.LIBRARY.get() is None, reason=f"rows kernel unavailable ({rows_linear.status()})"
)


def _case(rows: int, k: int, n: int, xdtype, wdtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(xdtype)
    w = torch.randn(n, k, generator=g).to(wdtype)
    b = torch.randn(n, generator=g).to(wdtype) if bias else None
    return x, w, b


def _float64(x, w, b):
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("k", [64, 77])  # 77: a tail after the last whole vector
@pytest.mark.parametrize(
    "xdtype,wdtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
    ],  # fmt: skip
)
def test_matches_a_float64_product(rows, k, xdtype, wdtype):
    x, w, b = _case(rows, k, 37, xdtype, wdtype, bias=True, seed=rows)
    got = rows_linear.rows_linear(x, w, b)
    want = _float64(x, w, b)
    assert got is not None and got.dtype == wdtype and got.shape == (rows, 37)
    # float32 sums in another order; a bf16 output is rounded once (half an ulp: 2^-9 relative)
    tol = 1e-5 if wdtype == torch.float32 else 2**-8
    assert float(((got.double() - want).abs() / want.abs().clamp_min(1.0)).max()) < tol


@needs_kernel
def test_declines_what_it_does_not_compute():
    x, w, _ = _case(rows_linear.MAX_ROWS + 1, 16, 8, torch.bfloat16, torch.bfloat16, False)
    assert rows_linear.rows_linear(x, w) is None  # a GEMM's size
    assert rows_linear.rows_linear(x[:2].float(), w) is None  # F.linear refuses the pair too
    assert rows_linear.rows_linear(x[:2].half(), w.half()) is None


@needs_kernel
def test_declines_a_bias_or_weight_of_the_wrong_shape():
    # A bias shorter than N was read past its end, a 3-D weight gave a [2, 1] result: F.linear
    # (the caller's fallback) refuses both and names the shapes.
    x, w, b = _case(2, 64, 37, torch.bfloat16, torch.bfloat16, bias=True)
    assert rows_linear.rows_linear(x, w, b[:3]) is None
    assert rows_linear.rows_linear(x, w, torch.cat([b, b])) is None
    assert rows_linear.rows_linear(x, w, b.view(1, 37)) is None
    assert rows_linear.rows_linear(x, w.view(1, 37, 64)) is None
    assert rows_linear.rows_linear(x, w.view(37, 1, 64)) is None
    assert rows_linear.rows_linear(x, w, b) is not None
    kernel = dense_linear.prepare(w)
    with pytest.raises(RuntimeError):
        kernel(x, b[:3])


@needs_kernel
def test_the_bf16_layer_kernel_uses_it_for_decode_rows_and_f_linear_beyond():
    x, w, b = _case(12, 80, 48, torch.bfloat16, torch.bfloat16, bias=True)
    kernel = dense_linear.prepare(w)
    assert isinstance(kernel, dense_linear.RowsBf16Linear)
    assert torch.equal(kernel(x, b), F.linear(x, w, b))  # 12 rows: F.linear on the plain weight
    x3 = x[:6].reshape(2, 3, 80)  # leading dimensions kept
    assert torch.equal(kernel(x3, b), rows_linear.rows_linear(x3, w, b))
    assert kernel(x3, b).shape == (2, 3, 48)


@needs_kernel
def test_a_decode_sized_product_records_as_a_step_graph():
    from llmhal_cpu import step_graph

    if step_graph.LIBRARY.get() is None:
        pytest.skip(f"replay library unavailable ({step_graph.LIBRARY.status})")
    x, w, b = _case(4, 64, 32, torch.bfloat16, torch.bfloat16, bias=True)
    kernel = dense_linear.prepare(w)
    out, graph, reason = step_graph.capture(lambda: kernel(x, b))
    assert graph is not None, reason
    x.copy_(torch.randn(4, 64))
    graph.replay()
    assert torch.equal(out, kernel(x, b))


def test_switched_off_keeps_onednn(monkeypatch):
    monkeypatch.setenv("LLMHAL_CPU_ROWS_KERNEL", "0")
    kernel = dense_linear.prepare(torch.randn(8, 8).bfloat16())
    assert kernel is None or isinstance(kernel, dense_linear.PackedBf16Linear)
