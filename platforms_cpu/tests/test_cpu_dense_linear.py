"""The CPU platform's ``dense_linear`` (``kernels/dense_linear.py``): bf16 weights packed once for
oneDNN give exactly ``F.linear``'s results; with the native few-row kernel a bf16 weight stays
plain (decode rows native, more rows ``F.linear``: see test_cpu_rows_linear.py); other dtypes keep
``F.linear``; a layer that takes the kernel drops its parameter, and reports the bytes and the
kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmhal_cpu.kernels import dense_linear

needs_onednn = pytest.mark.skipif(not dense_linear._enabled(), reason=dense_linear.status())


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 8, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_is_bit_identical_to_f_linear(rows, bias):
    g = _gen(rows)
    w = torch.randn(96, 80, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 80, generator=g).bfloat16()
    kernel = dense_linear.PackedBf16Linear(w)
    assert kernel.weight_bytes() == w.numel() * 2
    assert torch.equal(kernel(x, b), F.linear(x, w, b))
    # Leading dimensions are kept, as F.linear keeps them.
    x3 = torch.randn(2, 3, 80, generator=g).bfloat16()
    assert torch.equal(kernel(x3, b), F.linear(x3, w, b))


def test_other_dtypes_are_not_packed():
    for dtype in (torch.float32, torch.float16):
        assert dense_linear.prepare(torch.randn(8, 8).to(dtype)) is None


@needs_onednn
def test_a_wrong_activation_dtype_names_the_remedy():
    kernel = dense_linear.PackedBf16Linear(torch.randn(8, 16).bfloat16())
    with pytest.raises(ValueError, match="LLMHAL_CPU_DENSE_KERNEL=0"):
        kernel(torch.randn(2, 16), None)


@pytest.mark.parametrize("rows_kernel", ["1", "0"])
def test_switched_off_by_the_environment(monkeypatch, rows_kernel):
    """``LLMHAL_CPU_DENSE_KERNEL=0`` keeps ``F.linear`` whether or not the rows kernel builds (it
    used to hand out the rows kernel regardless, whose sums are in another order)."""
    monkeypatch.setenv("LLMHAL_CPU_DENSE_KERNEL", "0")
    monkeypatch.setenv("LLMHAL_CPU_ROWS_KERNEL", rows_kernel)
    dense_linear._switched_off.cache_clear()
    try:
        assert dense_linear.prepare(torch.randn(8, 8).bfloat16()) is None
        assert "LLMHAL_CPU_DENSE_KERNEL=0" in dense_linear.status()
        assert not dense_linear._enabled()
    finally:
        monkeypatch.undo()
        dense_linear._switched_off.cache_clear()
    assert dense_linear.prepare(torch.randn(8, 8).bfloat16()) is not None or not (
        dense_linear._enabled() or dense_linear.rows_linear.LIBRARY.get()
    )


@needs_onednn
def test_a_layer_takes_the_kernel_and_drops_its_parameter():
    from llmhal.testing.quant_layers import build_linear, finish, layer_output, weight_bytes

    layer = build_linear(None, "replicated", dtype=torch.bfloat16, bias=True, in_features=80,
                         out_features=48)  # fmt: skip
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 80, generator=_gen(3)))
        layer.bias.copy_(torch.randn(48, generator=_gen(4)))
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    x = torch.randn(5, 80, generator=_gen(5)).bfloat16()
    before = weight_bytes(layer)
    finish(layer)
    assert "weight" not in dict(layer.named_parameters())
    assert weight_bytes(layer) == before
    kernel = layer.dense_kernel
    assert kernel.name in layer.quant_method.describe(layer)
    got, want = layer_output(layer, x), F.linear(x, w, b)
    if isinstance(kernel, dense_linear.PackedBf16Linear):
        assert torch.equal(got, want)
    else:  # the native rows kernel: the same float32 sums in another order, one bf16 rounding
        torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-2)


@needs_onednn
def test_vocabulary_tables_keep_their_rows():
    from llmhal.testing.quant_layers import build_linear, finish

    head = finish(build_linear(None, "lm_head", dtype=torch.bfloat16, vocab=64, hidden=32))
    assert "weight" in dict(head.named_parameters())  # looked up by id, and tied heads share it


@needs_onednn
def test_a_step_with_a_packed_weight_is_refused_by_name_not_crashed():
    """oneDNN's packed weight has no storage; the step recorder names the op it cannot replay."""
    from llmhal_cpu import step_graph

    kernel = dense_linear.PackedBf16Linear(torch.randn(16, 8).bfloat16())
    x = torch.randn(2, 8).bfloat16()
    out, graph, reason = step_graph.capture(lambda: kernel(x))
    assert graph is None and "mkldnn::_linear_pointwise" in reason
    assert torch.equal(out, kernel(x))
