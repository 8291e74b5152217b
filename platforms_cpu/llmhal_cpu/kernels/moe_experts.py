"""The native MoE layer kernel (``moe_experts.cpp``): loading and the calls.

:func:`moe_layer` runs a whole decode-sized ``fused_moe`` in one native call, launched through
:func:`llmhal_cpu.step_graph.launch` so a decode step that contains it can be recorded: the routing
(softmax or sigmoid scores, the correction bias, grouped top-k, renormalisation, the scaling
factor; the same experts in the same order as core's ``select_experts``, ties included) and the
chosen experts' gated MLPs, summed in float32 and rounded once to the activations' dtype.
:func:`route` is the routing alone and :func:`moe_experts` the experts for a given routing.

Each returns None when the call is not one the kernel takes (a dtype or layout it does not read,
the library unavailable), so :mod:`llmhal_cpu.moe` falls back to core's torch path. Nothing here
converts or copies a tensor through torch: a call either passes the tensors it is given straight
to the kernel or declines. Built on first use by :mod:`llmhal_cpu.native_build`;
``LLMHAL_CPU_MOE_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from llmhal_cpu import native_build, step_graph

SOURCE = Path(__file__).with_name("moe_experts.cpp")
# The weight types the kernel reads (moe_experts.cpp's WeightType).
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
ACTIVATION_TYPES = (torch.float32, torch.bfloat16)
_SCORING = {"softmax": 0, "sigmoid": 1}  # moe_experts.cpp's Scoring; -1: routing given
_MAX_GROUPS = 256  # the kernel's bound on num_expert_group

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class MoeArgs(ctypes.Structure):  # mirrors moe_experts.cpp
    _fields_ = [
        ("x", _p), ("x_s", _i64), ("logits", _p), ("logits_s", _i64), ("bias", _p),
        ("ids", _p), ("weights", _p), ("w13", _p), ("w2", _p), ("s13", _p), ("s2", _p),
        ("out", _p), ("shared", _p), ("shared_s", _i64), ("shared_gate", _p), ("gate_s", _i64),
        ("t", _i64), ("experts", _i64), ("h", _i64), ("inter", _i64), ("k", _i64),
        ("scale", _f32), ("x_bf16", _i32), ("logits_bf16", _i32), ("out_bf16", _i32),
        ("wtype", _i32), ("scoring", _i32), ("renormalize", _i32), ("groups", _i32),
        ("topk_group", _i32), ("threads", _i32),
    ]  # fmt: skip


def _setup(lib: ctypes.CDLL) -> None:
    lib.llmhal_moe_args_size.argtypes = []
    lib.llmhal_moe_args_size.restype = ctypes.c_int64
    native_build.declare_struct_calls(
        lib, ("llmhal_moe_call",), {MoeArgs: lib.llmhal_moe_args_size()}
    )


LIBRARY = native_build.KernelLibrary(
    SOURCE, "moe_experts", _setup, disable_env="LLMHAL_CPU_MOE_KERNEL"
)


def status() -> str:
    """``"native"`` or why core's torch path runs (for ``llmhal doctor``)."""
    if LIBRARY.disabled():
        return "torch (LLMHAL_CPU_MOE_KERNEL=0)"
    return "native moe_experts" if LIBRARY.get() else f"torch ({LIBRARY.status})"


def _rows(x: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> bool:
    """2-D host memory of one of ``dtypes`` with contiguous rows (the layout the kernel reads)."""
    return x.dtype in dtypes and x.dim() == 2 and x.stride(-1) == 1 and x.is_cpu


def _f32_vector(x: torch.Tensor | None, n: int) -> bool:
    return x is None or (
        x.dtype == torch.float32 and x.numel() == n and x.is_contiguous() and x.is_cpu
    )


def _routing_fields(top_k: int, experts: int, routing: dict[str, Any]) -> dict[str, Any] | None:
    """The struct's routing fields for ``select_experts``'s options (absent ones at its
    defaults), or None for a routing the kernel does not take (core's ``select_experts`` then
    runs, and raises for the invalid ones with its own message)."""
    scoring_func = routing.get("scoring_func", "softmax")
    num_expert_group, topk_group = routing.get("num_expert_group"), routing.get("topk_group")
    e_score_correction_bias = routing.get("e_score_correction_bias")
    groups = num_expert_group or 1
    if scoring_func not in _SCORING or not _f32_vector(e_score_correction_bias, experts):
        return None
    if groups > 1 and (
        groups > _MAX_GROUPS or experts % groups or not topk_group or not 0 < topk_group <= groups
    ):
        return None
    if groups > 1 and e_score_correction_bias is not None and experts // groups < 2:
        return None
    if not 0 < top_k <= experts:
        return None
    return dict(
        bias=None if e_score_correction_bias is None else e_score_correction_bias.data_ptr(),
        k=top_k, scale=float(routing.get("routed_scaling_factor", 1.0)),
        scoring=_SCORING[scoring_func], renormalize=int(bool(routing.get("renormalize", True))),
        groups=groups if groups > 1 else 1,
        topk_group=int(topk_group or 0),
    )  # fmt: skip


def _launch(args: MoeArgs, experts: int) -> None:
    lib = LIBRARY.get()
    assert lib is not None
    if step_graph.launch(lib.llmhal_moe_call, args) != 0:
        raise IndexError(f"fused_moe: an expert id is outside 0..{experts - 1}")


def route(
    router_logits: torch.Tensor, top_k: int, **routing: Any
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``select_experts(router_logits, top_k, **routing)`` natively: (weights float32 [T, k],
    ids int64 [T, k]), or None."""
    e = router_logits.shape[-1]
    fields = _routing_fields(top_k, e, routing)
    if fields is None or not _rows(router_logits, ACTIVATION_TYPES) or LIBRARY.get() is None:
        return None
    t = router_logits.shape[0]
    ids = torch.empty(t, top_k, dtype=torch.int64, device="cpu")
    weights = torch.empty(t, top_k, dtype=torch.float32, device="cpu")
    args = MoeArgs(
        logits=router_logits.data_ptr(), logits_s=router_logits.stride(0), ids=ids.data_ptr(),
        weights=weights.data_ptr(), t=t, experts=e, wtype=0,
        logits_bf16=int(router_logits.dtype == torch.bfloat16), **fields,
    )  # fmt: skip
    _launch(args, e)
    return weights, ids


def _expert_fields(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
) -> dict[str, Any] | None:
    """The struct's expert fields for these tensors, or None when the kernel does not read them."""
    wtype = WEIGHT_TYPES.get(w13.dtype)
    if wtype is None or w2.dtype != w13.dtype or not _rows(hidden, ACTIVATION_TYPES):
        return None
    if w13.dim() != 3:
        return None  # not stacked experts: the caller's torch path names the shapes
    e, two_i, h = w13.shape
    if hidden.shape[1] != h or w2.shape != (e, h, two_i // 2):
        return None
    if not (w13.is_cpu and w13.is_contiguous() and w2.is_cpu and w2.is_contiguous()):
        return None
    int8 = wtype == WEIGHT_TYPES[torch.int8]
    if int8 != (w13_scale is not None and w2_scale is not None):
        return None
    if int8 and not (_f32_vector(w13_scale, e * two_i) and _f32_vector(w2_scale, e * h)):
        return None
    if LIBRARY.get() is None:  # reads LLMHAL_CPU_MOE_KERNEL each call: ~1 us a layer
        return None
    return dict(
        x=hidden.data_ptr(), x_s=hidden.stride(0), x_bf16=int(hidden.dtype == torch.bfloat16),
        w13=w13.data_ptr(), w2=w2.data_ptr(), wtype=wtype, experts=e, h=h, inter=two_i // 2,
        s13=None if w13_scale is None else w13_scale.data_ptr(),
        s2=None if w2_scale is None else w2_scale.data_ptr(), t=hidden.shape[0],
        threads=torch.get_num_threads(),
    )  # fmt: skip


def _shared_fields(
    hidden: torch.Tensor, shared: torch.Tensor | None, gate: torch.Tensor | None
) -> dict[str, Any] | None:
    """The struct's shared-expert fields, or None when the kernel does not read these tensors."""
    if shared is None:
        return {} if gate is None else None
    if not _rows(shared, (hidden.dtype,)) or shared.shape != hidden.shape:
        return None
    fields = {"shared": shared.data_ptr(), "shared_s": shared.stride(0)}
    if gate is not None:
        if gate.dtype != hidden.dtype or gate.dim() != 2 or gate.shape != (hidden.shape[0], 1):
            return None
        fields.update(shared_gate=gate.data_ptr(), gate_s=gate.stride(0))
    return fields


def moe_layer(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    shared_output: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    **routing: Any,
) -> torch.Tensor | None:
    """``fused_moe`` (silu) in one native call, in ``hidden``'s dtype [T, H], or None.

    ``hidden`` [T, H] and ``router_logits`` [T, E] float32 or bfloat16 with contiguous rows;
    ``w13`` [E, 2I, H] / ``w2`` [E, H, I] contiguous float32, bfloat16, or int8 with float32 row
    scales ``w13_scale`` [E, 2I] / ``w2_scale`` [E, H]; ``shared_output`` [T, H] and
    ``shared_gate`` [T, 1] in ``hidden``'s dtype (``fused_moe``'s shared part); ``routing``:
    ``select_experts``'s options.
    """
    fields = _expert_fields(hidden, w13, w2, w13_scale, w2_scale)
    route_fields = _routing_fields(top_k, w13.shape[0], routing)
    if fields is None or route_fields is None or not _rows(router_logits, ACTIVATION_TYPES):
        return None
    t, h = hidden.shape
    if router_logits.shape != (t, w13.shape[0]):
        return None
    shared = _shared_fields(hidden, shared_output, shared_gate)
    if shared is None:
        return None
    ids = torch.empty(t, top_k, dtype=torch.int64, device="cpu")
    weights = torch.empty(t, top_k, dtype=torch.float32, device="cpu")
    out = torch.empty(t, h, dtype=hidden.dtype, device="cpu")
    args = MoeArgs(
        logits=router_logits.data_ptr(), logits_s=router_logits.stride(0),
        logits_bf16=int(router_logits.dtype == torch.bfloat16), ids=ids.data_ptr(),
        weights=weights.data_ptr(), out=out.data_ptr(),
        out_bf16=int(hidden.dtype == torch.bfloat16), **fields, **route_fields, **shared,
    )  # fmt: skip
    _launch(args, w13.shape[0])
    return out


def moe_experts(
    hidden: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``sum_k weights[:, k] * w2[e_k] @ silu(gate) * up`` for a given routing, float32 [T, H],
    or None.

    ``weights`` float32 / ``ids`` int64 [T, k], contiguous (``select_experts``'s output); the
    other arguments as for :func:`moe_layer`. A routing whose shape does not fit ``hidden`` is an
    error (ValueError naming the shapes), not a call declined: the kernel reads T * k of each.
    """
    if ids.dim() != 2 or ids.shape != weights.shape or ids.shape[:1] != hidden.shape[:1]:
        raise ValueError(
            f"moe_experts: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be "
            f"[T, k], T being hidden's rows (hidden {tuple(hidden.shape)})"
        )
    fields = _expert_fields(hidden, w13, w2, w13_scale, w2_scale)
    if fields is None or ids.dtype != torch.int64 or weights.dtype != torch.float32:
        return None
    if not (ids.is_contiguous() and weights.is_contiguous() and ids.is_cpu and weights.is_cpu):
        return None
    t, k = ids.shape
    out = torch.empty(t, hidden.shape[1], dtype=torch.float32, device="cpu")
    args = MoeArgs(
        ids=ids.data_ptr(), weights=weights.data_ptr(), out=out.data_ptr(), k=k, scale=1.0,
        scoring=-1, **fields,
    )  # fmt: skip
    _launch(args, w13.shape[0])
    return out
