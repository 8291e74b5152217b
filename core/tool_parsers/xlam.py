"""``xlam``: Salesforce xLAM, calls as a JSON list ``[{"name": ..., "arguments": {...}}]``: the
whole answer (after any ``</think>``), or inside a ```` ```json ```` fence, after
``[TOOL_CALLS]`` or inside ``<tool_call>`` tags, with the text before those as the content."""

from __future__ import annotations

from typing import Any

from llmhal.tool_parsers.base import ToolCall
from llmhal.tool_parsers.incremental import SectionToolParser
from llmhal.tool_parsers.values import calls_from_objects, json_list_calls, json_objects

TAGS = ("```json", "```", "[TOOL_CALLS]", "<tool_call>")
THINK_END = "</think>"


class XLamToolParser(SectionToolParser):
    markers = (*TAGS, "[")

    def section_start(self, text: str) -> int:
        found = [i for i in (text.find(m) for m in TAGS) if i >= 0]
        if found:
            return min(found)
        after = text.rfind(THINK_END)
        after = 0 if after < 0 else after + len(THINK_END)
        body = text[after:].lstrip()
        return len(text) - len(body) if body.startswith("[") else -1

    def read(self, text: str, request: dict[str, Any], final: bool) -> tuple[str, list[ToolCall]]:
        if not final and self.section_start(text) < 0:
            think = text.rfind(THINK_END)
            answer = text[think + len(THINK_END) :] if think >= 0 else text
            if not answer.strip():  # the answer may still open with a list of calls
                return (text[:think] if think >= 0 else ""), []
        return super().read(text, request, final)

    def calls(self, section: str, request: dict[str, Any], final: bool) -> list[ToolCall]:
        tag = next((t for t in TAGS if section.startswith(t)), "")
        pos = len(tag)
        while pos < len(section) and section[pos].isspace():
            pos += 1
        if section.startswith("[", pos):
            return json_list_calls(section, pos)
        objs, _, _ = json_objects(section, pos)
        return calls_from_objects(objs)
