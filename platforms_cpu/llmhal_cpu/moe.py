"""CPU ``fused_moe`` (signature in :mod:`llmhal.ops.fused_moe`).

Core's grouped algorithm (tokens sorted by expert, only chosen experts computed, two matmuls per
active expert) with the CPU's fused ``silu_and_mul`` kernel for the gated activation: at decode the
step is bound by per-op overhead, and the activation is one native call here instead of three torch
calls. Other activations use core's definition. Quantized experts (GGUF, GPTQ) through the CPU's
quantized GEMM are not written yet: the only quantized expert layout today is ``experts_int8``,
which this kernel runs as core does (int8 rows converted per active expert).
"""

from __future__ import annotations

from typing import Any

import torch

from llmhal.ops import fused_moe as core_moe
from llmhal_cpu import ops as cpu_ops


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
        hidden, w13, w2, weights, ids, act_and_mul=act, w13_scale=w13_scale, w2_scale=w2_scale
    )


fused_moe.status = cpu_ops.fused_ops.status  # type: ignore[attr-defined]  # shown by llmhal doctor
