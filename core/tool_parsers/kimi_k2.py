"""``kimi_k2``: Moonshot Kimi K2, calls between ``<|tool_calls_section_begin|>`` and
``<|tool_calls_section_end|>`` (special tokens), each
``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>``.
``functions.NAME:INDEX`` is the call's id, as Kimi's chat template expects it back; the text
before the section is the content."""

from __future__ import annotations

import re
from typing import Any

from llmhal.tool_parsers.base import ToolCall
from llmhal.tool_parsers.incremental import SectionToolParser
from llmhal.tool_parsers.values import calls_from_matches

SECTION_BEGIN = "<|tool_calls_section_begin|>"
_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<id>(?:[\w.-]+\.)?(?P<name>[^\s:<]+?)(?::\d+)?)\s*<\|tool_call_argument_begin\|>(?P<args>.*?)<\|tool_call_end\|>",  # fmt: skip
    re.S,
)


class KimiK2ToolParser(SectionToolParser):
    markers = (SECTION_BEGIN, "<|tool_call_section_begin|>")  # the singular form occurs too

    def calls(self, section: str, request: dict[str, Any], final: bool) -> list[ToolCall]:
        return calls_from_matches(_CALL.finditer(section))
