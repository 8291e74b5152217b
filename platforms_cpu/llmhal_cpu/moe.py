"""CPU ``fused_moe`` (signature in :mod:`llmhal.ops.fused_moe`).

Core's grouped algorithm (tokens sorted by expert, only chosen experts computed, two matmuls per
active expert) with two CPU-specific pieces:

* the gated activation is the CPU's fused ``silu_and_mul`` kernel (one native call instead of
  three torch calls: decode is bound by per-op overhead);
* int8 experts (``experts_int8``) with bf16/fp16 activations run through torch's weight-only int8
  CPU matmul (``torch._weight_int8pack_mm``: int8 weights, one scale per row) instead of converting
  the expert's weights each step. Measured on this 2-core VM (one thread, [2, 1024] x [5632, 1024]):
  6-8.5 ms, against 15-17 ms for the same matmul with bf16 weights and 24-31 ms for converting then
  multiplying. With float32 activations that kernel was slower than converting (49-113 ms vs
  26-27 ms), so float32 keeps core's path.

Quantized experts of other formats (GGUF, GPTQ, AWQ, compressed-tensors) arrive as per-expert
``quant_linear`` kernels (:class:`~llmhal.ops.expert_kernels.ExpertKernels`), which the grouped
algorithm calls as each expert's matmul.
"""

from __future__ import annotations

from typing import Any

import torch

from llmhal.ops import fused_moe as core_moe
from llmhal_cpu import ops as cpu_ops

_INT8PACK_DTYPES = (torch.bfloat16, torch.float16)


def _project(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if scale is not None and x.dtype in _INT8PACK_DTYPES and hasattr(torch, "_weight_int8pack_mm"):
        return torch._weight_int8pack_mm(x.contiguous(), w, scale.to(x.dtype))
    return core_moe.project(x, w, scale)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    *,
    activation: str = "silu",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    **routing: Any,
) -> torch.Tensor:
    weights, ids = core_moe.select_experts(router_logits, top_k, **routing)
    act = cpu_ops.silu_and_mul if activation == "silu" else core_moe.gated_activation(activation)
    return core_moe.grouped_experts(
        hidden,
        w13,
        w2,
        weights,
        ids,
        act_and_mul=act,
        w13_scale=w13_scale,
        w2_scale=w2_scale,
        matmul=_project,
    )


# Experts held as ExpertKernels (GGUF, GPTQ, AWQ, compressed-tensors) run their own kernels inside
# core's grouped algorithm, which this op is built on.
fused_moe.accepts_expert_kernels = True  # type: ignore[attr-defined]
fused_moe.status = cpu_ops.fused_ops.status  # type: ignore[attr-defined]  # shown by llmhal doctor
