"""``jamba``: AI21 Jamba 1.5+, calls as a JSON list inside ``<tool_calls>`` ... ``</tool_calls>``
(``[{"name": ..., "arguments": {...}}]``); the text before the tag is the content."""

from __future__ import annotations

from typing import Any

from llmhal.tool_parsers.base import ToolCall
from llmhal.tool_parsers.incremental import SectionToolParser
from llmhal.tool_parsers.values import json_list_calls

START = "<tool_calls>"


class JambaToolParser(SectionToolParser):
    markers = (START,)

    def calls(self, section: str, request: dict[str, Any], final: bool) -> list[ToolCall]:
        return json_list_calls(section, len(START))
