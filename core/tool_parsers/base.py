"""The tool-call parser contract (vLLM's ``ToolParser``): find the function calls in a model's text.

A parser is built per request with the engine's tokenizer. :meth:`ToolParser.extract_tool_calls`
reads a finished output; :meth:`ToolParser.extract_tool_calls_streaming` is called with each new
piece of a streamed one (the text and token ids so far, before and after it) and returns what to
send now, or None for "nothing yet" (a call still being written). Calls come out as OpenAI's
``tool_calls`` entries; arguments are a JSON string, as OpenAI sends them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


@dataclass
class FunctionCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ToolCall:
    function: FunctionCall
    id: str = field(default_factory=tool_call_id)
    type: str = "function"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type,
                "function": {"name": self.function.name, "arguments": self.function.arguments}}  # fmt: skip


@dataclass
class DeltaToolCall:
    """One call's part of a stream event (vLLM's shape): ``index`` orders the request's calls;
    ``id`` and ``name`` come once, ``arguments`` text may come in pieces."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        fn = {
            k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None
        }
        if fn:
            out["function"] = fn
        return out


@dataclass
class DeltaMessage:
    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


@dataclass
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None  # the text that is not a call (None when there is none)


class ToolParser:
    """Base class of tool-call parsers (not abstract, as in vLLM: a parser may implement only the
    non-streaming path, and then a stream with tools is refused)."""

    def __init__(self, tokenizer: Any) -> None:
        self.model_tokenizer = tokenizer
        self.prev_tool_call_arr: list[dict[str, Any]] = []
        self.current_tool_id = -1
        self.streamed_args_for_tool: list[str] = []

    def adjust_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """The request body, possibly changed before generation (default: unchanged)."""
        return request

    def extract_tool_calls(
        self, model_output: str, request: dict[str, Any]
    ) -> ExtractedToolCallInformation:
        raise NotImplementedError(f"{type(self).__name__} does not parse finished outputs")

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: dict[str, Any],
    ) -> DeltaMessage | None:
        raise NotImplementedError(f"{type(self).__name__} does not parse streams")
