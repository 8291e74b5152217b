"""``internlm``: InternLM2/2.5 chat, a call as
``<|action_start|><|plugin|>\\n{"name": ..., "parameters": {...}}<|action_end|>`` (special
tokens); the text before ``<|action_start|>`` is the content."""

from __future__ import annotations

from typing import Any

from llmhal.tool_parsers.base import ToolCall
from llmhal.tool_parsers.incremental import SectionToolParser
from llmhal.tool_parsers.values import calls_from_objects, json_objects

START, PLUGIN, END = "<|action_start|>", "<|plugin|>", "<|action_end|>"


class InternLM2ToolParser(SectionToolParser):
    markers = (START,)

    def calls(self, section: str, request: dict[str, Any], final: bool) -> list[ToolCall]:
        out: list[ToolCall] = []
        for block in section.split(START)[1:]:
            body, closed, _ = block.partition(END)
            if not body.startswith(PLUGIN) or not (closed or final):
                continue
            objs, _, _ = json_objects(body, len(PLUGIN))
            out += calls_from_objects(objs[:1])
        return out
