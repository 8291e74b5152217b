"""``qwen3_coder``: Qwen3-Coder (and Qwen3.5), XML-style calls,
``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>``
(the ``<tool_call>`` wrapper is sometimes left out). Values are text, one newline trimmed at each
end; a parameter whose schema type is not ``string`` is read as JSON (or a Python literal) when
it parses. The text before the first call is the content."""

from __future__ import annotations

import re
from typing import Any

from llmhal.tool_parsers.base import ToolCall
from llmhal.tool_parsers.incremental import SectionToolParser
from llmhal.tool_parsers.values import typed_calls

_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def _trim(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class Qwen3CoderToolParser(SectionToolParser):
    markers = ("<tool_call>", "<function=")

    def calls(self, section: str, request: dict[str, Any], final: bool) -> list[ToolCall]:
        found = [(name, [(k, _trim(v)) for k, v in _PARAM.findall(body)]) for name, body in _FUNCTION.findall(section)]  # fmt: skip
        return typed_calls(found, request)
