"""``glm45``: GLM-4.5/4.6 (and 4.7), a call as
``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...</tool_call>``. Values
are text; a parameter whose schema type is not ``string`` is read as JSON (or a Python literal)
when it parses. The text before the first ``<tool_call>`` is the content."""

from __future__ import annotations

import re
from typing import Any

from llmhal.tool_parsers.base import ToolCall
from llmhal.tool_parsers.incremental import SectionToolParser
from llmhal.tool_parsers.values import typed_calls

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm45ToolParser(SectionToolParser):
    markers = ("<tool_call>",)

    def calls(self, section: str, request: dict[str, Any], final: bool) -> list[ToolCall]:
        found = []
        for body in _CALL.findall(section):
            name, _, rest = body.partition("<arg_key>")
            found.append((name, _ARG.findall("<arg_key>" + rest)))
        return typed_calls(found, request)
