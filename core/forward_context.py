"""Per-step state that layers read during a forward pass (set by the model runner).

Models keep clean signatures (``forward(input_ids, positions)``); attention layers find the step's
metadata here, keyed by backend name, because one model may use several backends (e.g. full and
sliding-window layers served by different ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmhal.attention.backend import CommonAttentionMetadata
from llmhal.utils.current import Current


@dataclass
class ForwardContext:
    common: CommonAttentionMetadata
    attn_metadata: dict[str, Any] = field(default_factory=dict)


_current: Current[ForwardContext] = Current(
    "No forward context: attention layers run only inside the model runner's step "
    "(llmhal.forward_context.set_forward_context)."
)
# ``with set_forward_context(ctx):`` makes ``ctx`` current in this thread for the step;
# get_forward_context() returns it, and raises RuntimeError (the text above) outside one.
set_forward_context = _current.using
get_forward_context = _current.get
