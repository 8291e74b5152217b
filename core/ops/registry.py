"""Custom-op dispatch.

Each op has a pure-torch implementation in :mod:`llmhal.ops.native` (``fused_moe`` in
:mod:`llmhal.ops.fused_moe`, the state-space ops in :mod:`llmhal.ops.mamba_ops`): the definition,
used in tests as the reference. The kernel that runs is resolved once per op and process, in this
order:

1. a kernel registered with :func:`register_op_kernel` (out-of-tree code, general plugins);
2. the active platform's ``Platform.op_kernels``;
3. core's native implementation.

A kernel that fails to import falls back to the next source with a warning (and the reason is kept
for ``llmhal doctor``). The op signatures are documented in :mod:`llmhal.ops.native`. A kernel may
also have a ``status()`` attribute (a zero-argument callable returning a string: which of its
paths runs on this host, and why); ``llmhal doctor`` shows it beside the op.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmhal.logger import init_logger

logger = init_logger(__name__)

CORE_OPS: dict[str, str] = {
    "rms_norm": "llmhal.ops.native:rms_norm",
    "fused_add_rms_norm": "llmhal.ops.native:fused_add_rms_norm",
    "rotary_embedding": "llmhal.ops.native:rotary_embedding",
    "silu_and_mul": "llmhal.ops.native:silu_and_mul",
    # A kernel class, not a function: see llmhal.ops.quant_linear for the contract.
    "quant_linear": "llmhal.ops.quant_linear:NativeQuantLinear",
    # A preparer of unquantized weights, not a function: see llmhal.ops.dense_linear.
    "dense_linear": "llmhal.ops.dense_linear:prepare",
    # Routing plus the experts' gated MLPs: see llmhal.ops.fused_moe for the signature.
    "fused_moe": "llmhal.ops.fused_moe:fused_moe",
    # A router wider than the model's activations (DeepSeek's float32 gate): see the function.
    "router_logits": "llmhal.ops.fused_moe:router_logits",
    # State-space and short-convolution ops: see llmhal.ops.mamba_ops for the signatures.
    "causal_conv1d_fn": "llmhal.ops.mamba_ops:causal_conv1d_fn",
    "causal_conv1d_update": "llmhal.ops.mamba_ops:causal_conv1d_update",
    "selective_scan_varlen": "llmhal.ops.mamba_ops:selective_scan_varlen",
    "selective_state_update": "llmhal.ops.mamba_ops:selective_state_update",
    "ssd_chunk_scan_varlen": "llmhal.ops.mamba_ops:ssd_chunk_scan_varlen",
    "gated_rms_norm": "llmhal.ops.mamba_ops:gated_rms_norm",
    # Linear attention with per-head decay (MiniMax): see llmhal.ops.linear_attn_ops.
    "lightning_attn_prefill": "llmhal.ops.linear_attn_ops:lightning_attn_prefill",
    "lightning_attn_decode": "llmhal.ops.linear_attn_ops:lightning_attn_decode",
}

# Ops that only layers of these kinds call (llmhal.attention.state's recurrent layers): a model
# without such layers never runs them, so a platform lacking them is no slow path for that model.
OP_LAYER_KINDS: dict[str, tuple[str, ...]] = {
    "causal_conv1d_fn": ("mamba1", "mamba2", "short_conv"),
    "causal_conv1d_update": ("mamba1", "mamba2", "short_conv"),
    "selective_scan_varlen": ("mamba1",),
    "selective_state_update": ("mamba1", "mamba2"),
    "ssd_chunk_scan_varlen": ("mamba2",),
    "gated_rms_norm": ("mamba2",),
    "lightning_attn_prefill": ("linear",),
    "lightning_attn_decode": ("linear",),
}


@dataclass(frozen=True)
class OpImplementation:
    name: str
    implementation: str  # class path of the kernel in use
    source: str  # "registered", the platform name, or "core"
    note: str = ""


_lock = threading.Lock()
_registered: dict[str, str] = {}
_resolved: dict[str, tuple[Callable[..., Any], OpImplementation]] = {}


def register_op_kernel(op: str, kernel_path: str) -> None:
    """Use ``kernel_path`` ("pkg.mod:function") for ``op`` from now on (resolution is redone)."""
    if op not in CORE_OPS:
        raise ValueError(f"unknown op {op!r}; ops: {', '.join(CORE_OPS)}")
    with _lock:
        _registered[op] = kernel_path
        _resolved.pop(op, None)


def _sources(op: str) -> list[tuple[str, str]]:
    from llmhal.platforms import get_current_platform

    out = []
    with _lock:
        if op in _registered:
            out.append((_registered[op], "registered"))
    platform = get_current_platform()
    if op in platform.op_kernels:
        out.append((platform.op_kernels[op], platform.name))
    out.append((CORE_OPS[op], "core"))
    return out


def get_op(op: str) -> Callable[..., Any]:
    """The kernel for ``op`` (resolved once)."""
    with _lock:
        hit = _resolved.get(op)
    if hit is not None:
        return hit[0]
    if op not in CORE_OPS:
        raise ValueError(f"unknown op {op!r}; ops: {', '.join(CORE_OPS)}")
    from llmhal.utils.imports import resolve_obj_by_qualname

    notes = []
    for path, source in _sources(op):
        try:
            fn = resolve_obj_by_qualname(path)
        except Exception as e:
            if source == "core":
                raise
            notes.append(f"{source} kernel {path} unavailable: {type(e).__name__}: {e}")
            logger.warning("Op %s: %s; falling back", op, notes[-1])
            continue
        impl = OpImplementation(op, path, source, "; ".join(notes))
        with _lock:
            _resolved[op] = (fn, impl)
        return fn
    raise AssertionError("unreachable: core implementation always resolves")


def op_implementation(op: str) -> OpImplementation:
    """Which implementation ``op`` uses (resolving it if needed; raises like :func:`get_op`)."""
    get_op(op)
    with _lock:
        return _resolved[op][1]


def op_implementations() -> list[OpImplementation]:
    """Which implementation each op uses (resolving any not yet resolved)."""
    return [op_implementation(op) for op in CORE_OPS]


def _reset_for_tests() -> None:
    with _lock:
        _registered.clear()
        _resolved.clear()
