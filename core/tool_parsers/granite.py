"""``granite``: IBM Granite 3.x, the whole answer a JSON list of calls
(``[{"name": ..., "arguments": {...}}]``), opened by ``<|tool_call|>`` (3.0, a special token) or
``<tool_call>`` (3.1 and later) or bare."""

from __future__ import annotations

from typing import Any

from llmhal.tool_parsers.base import ToolCall
from llmhal.tool_parsers.incremental import SectionToolParser
from llmhal.tool_parsers.values import json_list_calls


class GraniteToolParser(SectionToolParser):
    markers = ("<|tool_call|>", "<tool_call>", "[")
    at_start = True

    def calls(self, section: str, request: dict[str, Any], final: bool) -> list[ToolCall]:
        for m in self.markers[:2]:
            if section.startswith(m):
                return json_list_calls(section, len(m))
        return json_list_calls(section)
