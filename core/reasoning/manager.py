"""Reasoning parsers by name (vLLM's ``ReasoningParserManager``; ``llmhal serve
--reasoning-parser NAME [--reasoning-parser-plugin PATH]``)."""

from __future__ import annotations

from typing import ClassVar

from llmhal.reasoning.base import ReasoningParser
from llmhal.utils.parser_registry import ParserRegistry


class ReasoningParserManager(ParserRegistry):
    kind = "Reasoning parser"
    base = ReasoningParser
    plugin_package = "llmhal.reasoning.plugins"
    eager: ClassVar[dict[str, type]] = {}
    lazy: ClassVar[dict[str, tuple[str, str]]] = {}
    reasoning_parsers = eager  # vLLM's names for the two maps
    lazy_parsers = lazy

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        return cls.get(name)

    @classmethod
    def import_reasoning_parser(cls, path: str) -> None:
        cls.import_plugin(path)


for _name, _cls in (("deepseek_r1", "DeepSeekR1ReasoningParser"), ("qwen3", "Qwen3ReasoningParser")):  # fmt: skip
    ReasoningParserManager.register_lazy_module(_name, "llmhal.reasoning.parsers", _cls)
