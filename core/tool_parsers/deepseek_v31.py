"""``deepseek_v31``: DeepSeek-V3.1, calls between ``<｜tool▁calls▁begin｜>`` and
``<｜tool▁calls▁end｜>``, each ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``
(no type, no code fence, unlike V3). The text before the section is the content."""

from __future__ import annotations

import re
from typing import Any

from llmhal.tool_parsers.base import ToolCall
from llmhal.tool_parsers.deepseek_v3 import CALL_BEGIN, CALL_END, CALLS_BEGIN, SEP
from llmhal.tool_parsers.incremental import SectionToolParser
from llmhal.tool_parsers.values import calls_from_matches

_CALL = re.compile(re.escape(CALL_BEGIN) + r"(?P<name>.*?)" + re.escape(SEP) + r"(?P<args>.*?)" + re.escape(CALL_END), re.S)  # fmt: skip


class DeepSeekV31ToolParser(SectionToolParser):
    markers = (CALLS_BEGIN,)

    def calls(self, section: str, request: dict[str, Any], final: bool) -> list[ToolCall]:
        return calls_from_matches(_CALL.finditer(section))
