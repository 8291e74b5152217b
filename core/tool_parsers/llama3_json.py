"""``llama3_json`` (also ``llama4_json``): Llama 3.1-3.3 and Llama 4 with JSON tool calls, written
as ``{"name": ..., "parameters": {...}}`` (``arguments`` also read), several separated by ``;``,
either after ``<|python_tag|>`` or as the whole answer (an answer that opens with ``{``)."""

from __future__ import annotations

from typing import Any

from llmhal.tool_parsers.base import ToolCall
from llmhal.tool_parsers.incremental import SectionToolParser
from llmhal.tool_parsers.values import calls_from_objects, json_objects

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(SectionToolParser):
    markers = (PYTHON_TAG, "{")

    def section_start(self, text: str) -> int:
        tag = text.find(PYTHON_TAG)
        if tag >= 0:
            return tag
        body = text.lstrip()  # a bare JSON call is the whole answer, not JSON inside prose
        return len(text) - len(body) if body.startswith("{") else -1

    def calls(self, section: str, request: dict[str, Any], final: bool) -> list[ToolCall]:
        pos = len(PYTHON_TAG) if section.startswith(PYTHON_TAG) else 0
        objs, _, _ = json_objects(section, pos, separators=";")
        return calls_from_objects(objs)
