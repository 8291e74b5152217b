"""Per-step state that layers read during a forward pass (set by the model runner).

Models keep clean signatures (``forward(input_ids, positions)``); attention layers find the step's
metadata here, keyed by backend name, because one model may use several backends (e.g. full and
sliding-window layers served by different ones).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from llmhal.attention.backend import CommonAttentionMetadata


@dataclass
class ForwardContext:
    common: CommonAttentionMetadata
    attn_metadata: dict[str, Any] = field(default_factory=dict)


_local = threading.local()


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = prev


def get_forward_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError(
            "No forward context: attention layers run only inside the model runner's step "
            "(llmhal.forward_context.set_forward_context)."
        )
    return ctx
