"""Experts held as per-expert kernels rather than stacked tensors: the ``fused_moe`` op's second
weight form.

Stacked ``w13``/``w2`` tensors suit experts whose weights are plain matrices (or int8 with row
scales). Experts kept in a quantized checkpoint format (GGUF blocks, GPTQ/AWQ/compressed-tensors
groups) each become a kernel object instead: the same ``quant_linear`` kernels a quantized linear
layer gets, so the experts are never expanded to floats in memory. :class:`ExpertKernels` holds one
such callable per expert, indexable like a stacked tensor's first dimension, and ``fused_moe``
accepts it in place of ``w13`` and ``w2``:

* ``kernels[e](x)`` computes ``x @ W_e.T`` for the rows ``x`` [n, K] routed to expert ``e``, in
  ``x``'s dtype (``w13``: gate rows then up rows, [n, 2I]; ``w2``: [n, H]);
* ``weight_bytes()`` is what the kernels keep, for memory reports.

Core's reference ``fused_moe`` (and any platform kernel built on core's ``grouped_experts``) runs
them through :func:`llmhal.ops.fused_moe.project`. A platform ``fused_moe`` that accepts this form
says so with the attribute ``accepts_expert_kernels = True``; one without it keeps stacked tensors
only, and :class:`~llmhal.layers.fused_moe.FusedMoE` then runs kernel-held experts through core's
reference instead of handing the platform a form it cannot read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

ExpertKernel = Callable[[torch.Tensor], torch.Tensor]


class ExpertKernels:
    """One kernel per expert (module docstring)."""

    def __init__(self, kernels: Sequence[ExpertKernel], describe: str = "") -> None:
        self.kernels = list(kernels)
        self.shape = (len(self.kernels),)
        self.description = describe

    def __len__(self) -> int:
        return len(self.kernels)

    def __getitem__(self, e: int) -> ExpertKernel:
        return self.kernels[e]

    def weight_bytes(self) -> int:
        return sum(_bytes_of(k) for k in self.kernels)

    def __repr__(self) -> str:
        what = f" {self.description}" if self.description else ""
        return f"ExpertKernels({len(self.kernels)} experts{what})"


def _bytes_of(kernel: Any) -> int:
    own = getattr(kernel, "weight_bytes", None)
    if callable(own):
        return int(own())
    method = getattr(kernel, "quant_method", None)  # a linear layer used as the expert's kernel
    if method is not None:
        return int(method.weight_bytes(kernel))
    raise TypeError(f"expert kernel {kernel!r} reports no weight_bytes()")


def accepts_expert_kernels(op: Any) -> bool:
    """True when the ``fused_moe`` implementation ``op`` takes :class:`ExpertKernels` weights."""
    return bool(getattr(op, "accepts_expert_kernels", False))
