"""One reading for both paths: a parser says what a text holds (:meth:`IncrementalToolParser.read`),
and the finished answer and the stream both come from that reading, so a stream split anywhere
sends exactly what the finished text's reading holds.

``read(text, request, final)`` returns the content and the calls. On a finished text (``final``)
it is the answer: calls that are whole (an unclosed last one too, when its body is complete), and
the text as written when no call could be read. On a partial text it says only what can no longer
change: content up to where a call may begin (a trailing piece that may be the start of a marker
is held back), and the calls already closed. The stream sends what each reading adds to the
last; :class:`~llmhal.entrypoints.chat_tools.ToolStream` sends what is still owed at the end.

Malformed calls are skipped, good ones beside them kept (hermes's rule); a reading that raises is
logged and taken as "no calls", so a model's text never fails a request.

:class:`SectionToolParser` covers the common shape: content, then a section opened by a marker
(``<tool_call>``, ``[TOOL_CALLS]``, ...), read by :meth:`SectionToolParser.calls`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llmhal.logger import init_logger
from llmhal.tool_parsers.base import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    ToolParser,
)
from llmhal.tool_parsers.special_tokens import SpecialTokenText

logger = init_logger(__name__)


def make_call(name: Any, arguments: Any, call_id: str | None = None) -> ToolCall:
    """A ToolCall; ``arguments`` a dict (dumped as OpenAI's JSON text) or JSON text already.
    ValueError when the name is not a non-empty string or the arguments are not an object."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a tool call needs a function name, got {name!r}")
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got {arguments!r}")
    call = ToolCall(FunctionCall(name.strip(), json.dumps(arguments, ensure_ascii=False)))
    if call_id:
        call.id = call_id
    return call


def restore_reading(
    content: str, calls: list[ToolCall], table: dict[int, str] | None
) -> tuple[str, list[ToolCall]]:
    """A reading of a text with inert markers, in the text's own characters again."""
    if table is None:
        return content, calls
    for c in calls:
        c.function.name = c.function.name.translate(table)
        c.function.arguments = c.function.arguments.translate(table)
        c.id = c.id.translate(table)
    return content.translate(table), calls


def held_back(text: str, markers: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could be the beginning of one of ``markers``."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if m.startswith(text[-n:]):
                best = n
                break
    return best


class IncrementalToolParser(ToolParser):
    """Subclasses implement :meth:`read`. Special tokens stay in the text when the request has
    tools (``adjust_request``): most families' markers are special tokens of their vocabulary."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._sent_content = ""  # what the stream has sent
        self._sent_calls = 0
        self._special: SpecialTokenText | None = None  # made when ids first come

    def read(self, text: str, request: dict[str, Any], final: bool) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def adjust_request(self, request: dict[str, Any]) -> dict[str, Any]:
        if request.get("tools") and request.get("tool_choice") != "none":
            return {**request, "skip_special_tokens": False}
        return request

    def _safe_read(
        self, text: str, request: dict[str, Any], final: bool, ids: Sequence[int] | None = None
    ) -> tuple[str, list[ToolCall]]:
        """:meth:`read`, never raising; with the output's token ids, markers the model wrote in
        ordinary tokens are text (:mod:`llmhal.tool_parsers.special_tokens`)."""
        table = None
        if ids and self.model_tokenizer is not None:
            self._special = self._special or SpecialTokenText(self.model_tokenizer)
            text, table = self._special.inert(text, ids)
        try:
            content, calls = self.read(text, request or {}, final)
        except Exception:  # a parser bug must not fail the request: the text is the answer
            logger.exception("%s could not read the model's output", type(self).__name__)
            content, calls = (text if final else ""), []
        return restore_reading(content, calls, table)

    def extract_tool_calls(
        self,
        model_output: str,
        request: dict[str, Any],
        token_ids: Sequence[int] | None = None,
    ) -> ExtractedToolCallInformation:
        """``token_ids`` (llmhal's addition to vLLM's signature): the output's ids, when the
        caller has them, so that only markers produced as tokens open calls."""
        content, calls = self._safe_read(model_output, request, True, token_ids)
        return ExtractedToolCallInformation(bool(calls), calls, content or None)

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
        content, calls = self._safe_read(current_text, request, False, current_token_ids)
        delta = DeltaMessage()
        if content.startswith(self._sent_content) and len(content) > len(self._sent_content):
            delta.content = content[len(self._sent_content) :]
            self._sent_content = content
        for call in calls[self._sent_calls :]:
            self.current_tool_id += 1
            self._sent_calls += 1
            self.prev_tool_call_arr.append({"name": call.function.name, "arguments": json.loads(call.function.arguments)})  # fmt: skip
            self.streamed_args_for_tool.append(call.function.arguments)
            delta.tool_calls.append(DeltaToolCall(self.current_tool_id, call.id, call.function.name, call.function.arguments))  # fmt: skip
        return delta if delta.content or delta.tool_calls else None


class SectionToolParser(IncrementalToolParser):
    """Content, then calls from the first of ``markers`` on. With ``at_start`` the section must
    open the output (after whitespace), as in formats where a call is the whole answer (pythonic,
    granite); otherwise a marker anywhere opens it and the text before it is the content."""

    markers: tuple[str, ...] = ()
    at_start: bool = False

    def calls(self, section: str, request: dict[str, Any], final: bool) -> list[ToolCall]:
        """The calls in ``section`` (the text from the marker on): the closed ones, and with
        ``final`` a last one cut short whose body is whole."""
        raise NotImplementedError

    def section_start(self, text: str) -> int:
        """Where the calls begin, or -1."""
        if self.at_start:
            body = text.lstrip()
            return len(text) - len(body) if body.startswith(self.markers) else -1
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else -1

    def read(self, text: str, request: dict[str, Any], final: bool) -> tuple[str, list[ToolCall]]:
        start = self.section_start(text)
        if start < 0:
            if final:
                return text, []
            if self.at_start:  # all of it may still be the start of a section
                body = text.lstrip()
                if any(m.startswith(body) for m in self.markers):
                    return "", []
                return text, []
            return _unless_blank(text[: len(text) - held_back(text, self.markers)]), []
        calls = self.calls(text[start:], request, final)
        if final and not calls:
            return text, []
        return _unless_blank(text[:start]), calls


def _unless_blank(content: str) -> str:
    """Whitespace before a call is not content (and is held back until it may be)."""
    return content if content.strip() else ""
