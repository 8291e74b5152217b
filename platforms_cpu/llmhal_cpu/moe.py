"""CPU ``fused_moe`` (signature in :mod:`llmhal.ops.fused_moe`).

Decode-sized calls (at most :data:`KERNEL_ROWS_PER_EXPERT` (token, choice) pairs per expert on
average) run the native kernel ``kernels/moe_experts.cpp``: the whole layer in one call, the routing
(the same experts as core's ``select_experts``) and then each active expert's weights streamed once
for all its tokens (float32, bfloat16 or int8 weights). The call makes no torch op, so a decode
step of a MoE model can be recorded as a step graph (:mod:`llmhal_cpu.step_graph`). Measured on this 2-core VM (one thread, CPU time, DeepSeek-V2-Lite-like layer
[8 tokens, 16 experts of 384, top-4, hidden 512]): 0.73 ms against 2.6 ms through torch in
bfloat16, 1.16 ms against 3.9 ms in float32; Mixtral-like [8 tokens, 8 experts of 2816, top-2,
hidden 1024] in bfloat16: 6.6 ms against 10.2 ms. With 8 rows an expert the kernel's
dot products become compute-bound and torch's GEMMs win (Mixtral-like, 32 tokens: 26 ms against
13 ms), so prefill and large batches take the grouped path below.

Otherwise core's grouped algorithm (tokens sorted by expert, only chosen experts computed, two
matmuls per active expert) with two CPU-specific pieces:

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
from llmhal_cpu.kernels import moe_experts, rows_linear

# Above this many (token, choice) pairs per expert on average, torch's GEMMs beat the kernel's
# dot products (see the module docstring).
KERNEL_ROWS_PER_EXPERT = 4

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
    shared_output: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    **routing: Any,
) -> torch.Tensor:
    if (
        isinstance(w13, torch.Tensor)  # not ExpertKernels (per-expert quantized kernels)
        and activation == "silu"
        and hidden.shape[0] * top_k <= KERNEL_ROWS_PER_EXPERT * w13.shape[0]
    ):
        out = moe_experts.moe_layer(
            hidden, router_logits, top_k, w13, w2, w13_scale, w2_scale, shared_output,
            shared_gate, **routing,
        )  # fmt: skip
        if out is not None:
            return out
    weights, ids = core_moe.select_experts(router_logits, top_k, **routing)
    act = cpu_ops.silu_and_mul if activation == "silu" else core_moe.gated_activation(activation)
    out = core_moe.grouped_experts(
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
    return core_moe.add_shared(out, shared_output, shared_gate)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The ``router_logits`` op (:func:`llmhal.ops.fused_moe.router_logits`): decode rows through
    the native rows kernel (bf16 activations widened inside it, so a recorded step holds no
    cast), others through core's."""
    out = rows_linear.rows_linear(x, weight)
    return out if out is not None else core_moe.router_logits(x, weight)


# Experts held as ExpertKernels (GGUF, GPTQ, AWQ, compressed-tensors) run their own kernels inside
# core's grouped algorithm, which this op is built on.
fused_moe.accepts_expert_kernels = True  # type: ignore[attr-defined]
fused_moe.accepts_shared_output = True  # type: ignore[attr-defined]
fused_moe.status = moe_experts.status  # type: ignore[attr-defined]  # shown by llmhal doctor
