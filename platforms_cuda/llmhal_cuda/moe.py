"""CUDA ``fused_moe`` (signature in :mod:`llmhal.ops.fused_moe`): FlashInfer's CUTLASS fused-MoE
kernel (``flashinfer.fused_moe.cutlass_fused_moe``, TensorRT-LLM's MoE GEMMs), imported on first use.

Routing stays core's :func:`~llmhal.ops.fused_moe.select_experts` (softmax/sigmoid, grouped top-k,
the V3 bias, renormalization and scaling, all in float32 on the GPU); the kernel then runs every
chosen expert's gated MLP and the weighted sum in one call: ``token_selected_experts`` int32 [T, k],
``token_final_scales`` float32 [T, k], ``fc1_expert_weights`` [E, 2I, H], ``fc2_expert_weights``
[E, H, I], no quantization scales. TensorRT-LLM's SwiGLU reads the *up* rows first and the gate
rows second (vLLM swaps its gate-first ``w13`` the same way before calling it), so the wrapper
keeps an up-first copy of each ``w13`` it sees: made once per weight tensor, it holds the experts'
gate and up weights a second time. A load-time relayout hook for platforms would remove that copy;
it is not written.

What it does not take goes to core's grouped implementation, so the op never fails where core's
would run: int8 experts (``experts_int8`` scales), experts held as
:class:`~llmhal.ops.expert_kernels.ExpertKernels` (this op does not declare
``accepts_expert_kernels``, so the layer never hands it those), activations other than SiLU,
float32 or CPU tensors, and hosts without a usable FlashInfer (``libraries.flashinfer_moe_reason``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from llmhal.ops import fused_moe as core_moe
from llmhal_cuda.libraries import flashinfer_moe_reason

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
# id(w13) -> (a weak reference to it, its version when copied, the up-first copy). Tensors compare
# elementwise, so they cannot key a WeakKeyDictionary; the entry goes when the tensor does.
_UP_FIRST: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}


def up_first(w13: torch.Tensor) -> torch.Tensor:
    """``w13`` [E, 2I, H] with each expert's up rows before its gate rows (made once per tensor)."""
    key = id(w13)
    cached = _UP_FIRST.get(key)
    if cached is not None and cached[0]() is w13 and cached[1] == w13._version:
        return cached[2]
    i = w13.shape[1] // 2
    swapped = torch.cat([w13[:, i:], w13[:, :i]], dim=1).contiguous()
    if cached is None or cached[0]() is not w13:
        weakref.finalize(w13, _UP_FIRST.pop, key, None)
    _UP_FIRST[key] = (weakref.ref(w13), w13._version, swapped)
    return swapped


def kernel_declines(
    hidden: torch.Tensor, w13: Any, activation: str, w13_scale: torch.Tensor | None
) -> str | None:
    """Why this call goes to core's implementation instead of the kernel (None: it does not)."""
    if not isinstance(w13, torch.Tensor):
        return "experts held as per-expert kernels"
    if w13_scale is not None:
        return "int8 experts (experts_int8)"
    if activation != "silu":
        return f"activation {activation!r} (the kernel's gated activation here is SwiGLU)"
    if hidden.dtype not in KERNEL_DTYPES or w13.dtype != hidden.dtype:
        return f"{hidden.dtype} activations with {w13.dtype} experts (bfloat16/float16 only)"
    if not hidden.is_cuda:
        return "tensors not on a CUDA device"
    return flashinfer_moe_reason()


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
    if kernel_declines(hidden, w13, activation, w13_scale) is not None:
        return core_moe.fused_moe(
            hidden, w13, w2, router_logits, top_k, activation=activation,
            w13_scale=w13_scale, w2_scale=w2_scale, **routing,
        )  # fmt: skip
    from flashinfer.fused_moe import cutlass_fused_moe

    weights, ids = core_moe.select_experts(router_logits, top_k, **routing)
    return cutlass_fused_moe(
        hidden.contiguous(),
        ids.to(torch.int32),
        weights.to(torch.float32),
        up_first(w13),
        w2,
        hidden.dtype,
        [],
    )


fused_moe.status = lambda: flashinfer_moe_reason() or "FlashInfer CUTLASS fused MoE"  # type: ignore[attr-defined]
