"""Unquantized bfloat16 linear layers through oneDNN with the weight packed once (``dense_linear``,
contract in :mod:`llmhal.ops.dense_linear`).

``F.linear`` on a plain bf16 weight makes oneDNN reorder the weight into its blocked layout inside
every call: at decode sizes that reorder is as costly as the product itself. Packing the weight
once at load (``torch.ops.mkldnn._reorder_linear_weight``, the layout ``_linear_pointwise`` reads)
removes it. Measured on this project's 2-core AVX-512 (avx512_bf16) host, one thread, CPU time:
[8, 768] x [768, 3352] 0.27 -> 0.15 ms, [8, 2048] x [2048, 768] 0.16 -> 0.09 ms, [1, 768] x
[768, 3352] 0.17-0.22 -> 0.09 ms; prompt-sized products (256 rows) the same or a few % faster. The
results are bit-identical to ``F.linear``'s (the same oneDNN kernel, without the reorder).

Where the native few-row kernel (:mod:`llmhal_cpu.kernels.rows_linear`) is available, a bf16 weight
is kept plain instead (:class:`RowsBf16Linear`): calls of up to ``rows_linear.MAX_ROWS`` rows (decode
steps) run that kernel, which is faster than the packed product at those sizes (one thread, weights
in cache: [8, 1024] x [1024, 1536] 0.064 ms against 0.09-0.10; [8, 512] x [512, 2304] 0.054 against
0.069-0.081; [1, 1024] x [1024, 1536] 0.043 against 0.058-0.061) and, being a
native call, lets a bf16 model's decode step be recorded as a step graph (a oneDNN call cannot be:
:mod:`llmhal_cpu.step_graph`); larger calls run ``F.linear`` on the plain weight, where oneDNN's
reorder costs about a quarter more at 16 rows and little beyond 64. Its results differ from
``F.linear``'s only in the order of the float32 sums (one bf16 rounding of the output either way).
``LLMHAL_CPU_ROWS_KERNEL=0`` keeps the packed form (the rows kernel is then off for the MoE
router too, :func:`llmhal_cpu.moe.router_logits`).

Only bfloat16 weights are packed: for float32 oneDNN's packed product is faster too but rounds
differently from ``F.linear`` (1e-4 on these shapes), which would move the float32 parity tests'
log-probabilities; float16 and other dtypes keep ``F.linear``. ``LLMHAL_CPU_DENSE_KERNEL=0`` turns
this module off: every layer keeps ``F.linear`` on its plain weight (neither the rows kernel nor
packing; results bit-identical to ``F.linear``, and bf16 decode steps no longer record), read once
per process, at the first prepared layer. It does not reach the MoE router, which only
``LLMHAL_CPU_ROWS_KERNEL=0`` turns off.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F

from llmhal_cpu.kernels import rows_linear


@functools.cache
def _switched_off() -> bool:
    """``LLMHAL_CPU_DENSE_KERNEL=0``: every layer keeps ``F.linear`` (read once per process)."""
    value = os.environ.get("LLMHAL_CPU_DENSE_KERNEL", "1").strip().lower()
    return value in ("0", "false", "no")


@functools.cache
def _onednn() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


def _enabled() -> bool:
    """Whether weights are packed for oneDNN where the rows kernel is unavailable."""
    return not _switched_off() and _onednn()


def status() -> str:
    """Which path runs (for ``llmhal doctor``)."""
    if _switched_off():
        return "torch F.linear (off: LLMHAL_CPU_DENSE_KERNEL=0)"
    if rows_linear.LIBRARY.get() is not None:
        return f"bfloat16: native rows kernel ({rows_linear.status()}), F.linear beyond"
    if not _enabled():
        return "torch F.linear (oneDNN packing unavailable)"
    return "oneDNN packed bfloat16 weights (F.linear for other dtypes)"


class PackedBf16Linear:
    """A bf16 weight in oneDNN's blocked layout; ``__call__`` is ``F.linear`` on the original."""

    name = "onednn_packed_bf16"

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self._nbytes = weight.numel() * weight.element_size()
        # The batch-size hint only picks the packed layout; 8 (a decode batch) served 1 to 256
        # rows as fast as a hint of 1 did, or faster.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 8)

    def weight_bytes(self) -> int:
        return self._nbytes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or not x.is_cpu or x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self.name}: expects bfloat16 host activations of {self.in_features} features, "
                f"got {x.dtype} {tuple(x.shape)} on {x.device}; the layer's weight is bfloat16, "
                "so its input must be too (cast it, or set LLMHAL_CPU_DENSE_KERNEL=0)"
            )
        lead = x.shape[:-1]
        # _linear_pointwise takes a 2-D input; an empty batch needs no call.
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_empty(*lead, self.out_features)
        if bias is not None and bias.dtype != torch.bfloat16:
            bias = bias.to(torch.bfloat16)
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, bias, "none", [None], "")
        return y.view(*lead, self.out_features)


class RowsBf16Linear:
    """A plain bf16 weight: decode-sized calls through the native few-row kernel, others
    ``F.linear`` (see the module docstring)."""

    name = "native_rows_bf16"

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = rows_linear.rows_linear(x, self.weight, bias) if x.dtype == torch.bfloat16 else None
        return out if out is not None else F.linear(x, self.weight, bias)


def prepare(weight: torch.Tensor) -> Any:
    """A kernel for a bf16 host weight (the native few-row one, else oneDNN's packed form), else
    None (the layer keeps ``F.linear``; always so with ``LLMHAL_CPU_DENSE_KERNEL=0``)."""
    if weight.dtype != torch.bfloat16 or not weight.is_cpu or weight.dim() != 2:
        return None
    if weight.numel() == 0 or _switched_off():
        return None
    if rows_linear.LIBRARY.get() is not None:
        return RowsBf16Linear(weight)
    return PackedBf16Linear(weight) if _enabled() else None


prepare.status = status  # type: ignore[attr-defined]  # shown by llmhal doctor
