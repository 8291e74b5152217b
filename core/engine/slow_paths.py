"""Where a model runs core's pure-torch reference code because the platform brings nothing better.

The reference attention backend and core's native ops define llmhal's semantics and run anywhere,
which is why a platform that brings no kernel of its own still works, but slowly. Slow must not be
silent: the engine logs these notes as warnings at start-up and ``llmhal doctor`` lists them, each
with what it costs and what removes it.

Attention counts as "on the reference" when the selected backend's implementation is the reference
one (also when a platform's backend only reuses it, as docs/writing-a-platform.md's example does),
unless the user chose that backend explicitly. An op counts when its implementation comes from core.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# Measured with `llmhal generate` on the default model (SmolLM2-135M Q4_1 GGUF, float32, 48 new
# tokens) on this project's 2-core machine, shared with other jobs, so the ranges are wide: the CPU
# platform decoded 18.9-28.9 tokens/s; with --attention-backend reference 2.7-11.7 tokens/s; on a
# platform with reference attention and no op kernels (the fake vendor `fakenpu`) 0.4-0.7 tokens/s.
ATTENTION_COST = (
    "it loops over the requests of each step in Python, in float32; on the default model decode "
    "ran 1.7-10x slower than with the CPU platform's native backend"
)
QUANT_LINEAR_COST = (
    "core's quant_linear dequantizes packed weights on every call; together with reference "
    "attention, decode of the default model ran 29-72x slower than on the CPU platform's kernels "
    "(0.4-0.7 against 20-29 tokens/s)"
)
OPS_COST = "each runs as several unfused torch calls with a temporary tensor between them"


def _uses_reference_impl(backend: Any) -> bool:
    from llmhal.attention.reference import ReferenceAttentionImpl

    try:
        impl = backend.get_impl_cls()
    except Exception:  # a backend that cannot even name its impl is reported elsewhere
        return False
    return isinstance(impl, type) and issubclass(impl, ReferenceAttentionImpl)


def attention_notes(selections: Iterable[Any], platform: Any) -> list[str]:
    """One note per distinct backend choice that runs the reference attention implementation."""
    out: list[str] = []
    seen: set[str] = set()
    for sel in selections:
        if sel.selected_by != "priority" or sel.name in seen:
            continue  # an explicit choice is the user's, not a silent fallback
        if not _uses_reference_impl(sel.backend):
            continue
        seen.add(sel.name)
        how = (
            "is core's reference backend"
            if sel.name == "reference"
            else ("reuses core's reference implementation")
        )
        rejected = "; ".join(f"{n}: {', '.join(r)}" for n, r in sel.rejected)
        why = f" (ranked before it, not usable here: {rejected})" if rejected else ""
        out.append(
            f"attention runs on core's pure-torch reference: backend {sel.name!r} {how}, and the "
            f"{platform.name} platform brings no faster backend for {sel.requirements.describe()}"
            f"{why}. Cost: {ATTENTION_COST}. A platform adds a native backend through "
            f"Platform.attention_backends (docs/writing-a-platform.md)."
        )
    return out


def ops_notes(platform: Any, kinds: set[str] | None = None) -> list[str]:
    """One note listing the ops that run core's pure-torch implementation, or none. With
    ``kinds`` (the model's layer kinds), ops that only other kinds' layers call are left out."""
    from llmhal.ops.registry import OP_LAYER_KINDS, op_implementations

    def used(op: str) -> bool:
        return kinds is None or op not in OP_LAYER_KINDS or bool(kinds & set(OP_LAYER_KINDS[op]))

    native = [i.name for i in op_implementations() if i.source == "core" and used(i.name)]
    if not native:
        return []
    cost = QUANT_LINEAR_COST if "quant_linear" in native else OPS_COST
    return [
        f"ops {', '.join(native)} run core's pure-torch implementations: the {platform.name} "
        f"platform provides no kernel for them (Platform.op_kernels). Cost: {cost}."
    ]


def slow_path_notes(selections: Iterable[Any], platform: Any) -> list[str]:
    """``selections``: the model's layers' backend selections (their kinds decide which
    layer-specific ops count)."""
    selections = list(selections)
    kinds = {s.requirements.kind for s in selections} if selections else None
    return attention_notes(selections, platform) + ops_notes(platform, kinds)
