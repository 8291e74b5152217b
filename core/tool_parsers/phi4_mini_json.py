"""``phi4_mini_json``: Phi-4-mini, calls as ``functools[{"name": ..., "arguments": {...}}]``;
the text before ``functools`` is the content."""

from __future__ import annotations

from typing import Any

from llmhal.tool_parsers.base import ToolCall
from llmhal.tool_parsers.incremental import SectionToolParser
from llmhal.tool_parsers.values import json_list_calls

START = "functools"


class Phi4MiniJsonToolParser(SectionToolParser):
    markers = (START + "[",)

    def calls(self, section: str, request: dict[str, Any], final: bool) -> list[ToolCall]:
        return json_list_calls(section, len(START))
