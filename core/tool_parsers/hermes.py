"""``hermes``: calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(Hermes 2 Pro, Qwen2.5 and Qwen3 instruct models, and others trained on that format). Text before
the first call is the message's content. ``<tool_call>`` is a special token in those vocabularies,
so the request keeps special tokens in its text (``adjust_request``); given the output's token ids,
only a ``<tool_call>`` the model produced as that token opens a call.

Streaming sends the content as it comes, holding back anything that may be the start of a
``<tool_call>`` tag, and each call whole once its closing tag arrives.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from llmhal.tool_parsers.base import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    ToolParser,
    tool_call_id,
)
from llmhal.tool_parsers.incremental import restore_reading
from llmhal.tool_parsers.special_tokens import SpecialTokenText

START, END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.S)
_CLOSED = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _call(text: str) -> ToolCall:
    """One call's JSON as a ToolCall; ValueError if it is not ``{"name", "arguments"}``."""
    obj = json.loads(text)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError(f"not a tool call: {text!r}")
    args = obj.get("arguments", {})
    return ToolCall(FunctionCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))  # fmt: skip


def _held_back(text: str) -> int:
    """How many trailing characters of ``text`` could be the beginning of a START tag."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser(ToolParser):
    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._content_sent = 0  # characters of content streamed so far
        self._closed_seen = 0  # closed <tool_call> blocks handled so far (malformed ones too)
        self._special: SpecialTokenText | None = None

    def adjust_request(self, request: dict[str, Any]) -> dict[str, Any]:
        if request.get("tools") and request.get("tool_choice") != "none":
            return {**request, "skip_special_tokens": False}
        return request

    def _inert(self, text: str, ids: Sequence[int] | None) -> tuple[str, dict[int, str] | None]:
        """The text with markers the model wrote in ordinary tokens made inert (when the ids
        are known: :mod:`llmhal.tool_parsers.special_tokens`)."""
        if not ids or self.model_tokenizer is None:
            return text, None
        self._special = self._special or SpecialTokenText(self.model_tokenizer)
        return self._special.inert(text, ids)

    def extract_tool_calls(
        self,
        model_output: str,
        request: dict[str, Any],
        token_ids: Sequence[int] | None = None,
    ) -> ExtractedToolCallInformation:
        """``token_ids``: as :meth:`IncrementalToolParser.extract_tool_calls` takes them."""
        model_output, table = self._inert(model_output, token_ids)
        info = self._extract(model_output)
        if table is not None:
            content, calls = restore_reading(info.content or "", info.tool_calls, table)
            info = ExtractedToolCallInformation(info.tools_called, calls, content or None)
        return info

    def _extract(self, model_output: str) -> ExtractedToolCallInformation:
        start = model_output.find(START)
        if start < 0:
            return ExtractedToolCallInformation(False, [], model_output)
        calls = []
        for a, b in _CALLS.findall(model_output):
            try:
                calls.append(_call(a if a else b))
            except ValueError:  # a malformed call is dropped (a stream skips it too)
                continue
        if not calls:  # nothing readable: the text is the answer, as it stands
            return ExtractedToolCallInformation(False, [], model_output)
        return ExtractedToolCallInformation(True, calls, model_output[:start] or None)

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
        current_text, table = self._inert(current_text, current_token_ids)
        start = current_text.find(START)
        content_end = start if start >= 0 else len(current_text) - _held_back(current_text)
        delta = DeltaMessage()
        if content_end > self._content_sent:
            delta.content = current_text[self._content_sent : content_end]
            self._content_sent = content_end
        if start >= 0:
            closed = _CLOSED.findall(current_text, start)
            for body in closed[self._closed_seen :]:
                self._closed_seen += 1
                try:
                    call = _call(body)
                except ValueError:
                    continue  # a malformed call is skipped, as the finished text's reading drops it
                self.current_tool_id += 1
                self.prev_tool_call_arr.append({"name": call.function.name})
                self.streamed_args_for_tool.append(call.function.arguments)
                delta.tool_calls.append(
                    DeltaToolCall(
                        self.current_tool_id,
                        tool_call_id(),
                        call.function.name,
                        call.function.arguments,
                    )  # fmt: skip
                )
        if table is not None:
            delta.content = SpecialTokenText.restore(delta.content, table)
            for d in delta.tool_calls:
                d.name = SpecialTokenText.restore(d.name, table)
                d.arguments = SpecialTokenText.restore(d.arguments, table)
        return delta if delta.content or delta.tool_calls else None
