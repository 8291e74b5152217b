"""``deepseek_v3``: DeepSeek-V3 and R1 (0528), calls between ``<｜tool▁calls▁begin｜>`` and
``<｜tool▁calls▁end｜>`` (special tokens, with full-width bars), each
``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``.
The text before the section is the content."""

from __future__ import annotations

import re
from typing import Any

from llmhal.tool_parsers.base import ToolCall
from llmhal.tool_parsers.incremental import SectionToolParser
from llmhal.tool_parsers.values import calls_from_matches

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_CALL = re.compile(
    re.escape(CALL_BEGIN)
    + r"(?P<type>.*?)"
    + re.escape(SEP)
    + r"(?P<name>.*?)\n```json\n(?P<args>.*?)\n```\s*"
    + re.escape(CALL_END),  # fmt: skip
    re.S,
)


class DeepSeekV3ToolParser(SectionToolParser):
    markers = (CALLS_BEGIN,)

    def calls(self, section: str, request: dict[str, Any], final: bool) -> list[ToolCall]:
        return calls_from_matches(_CALL.finditer(section))
