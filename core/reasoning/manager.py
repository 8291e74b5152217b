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


# vLLM's names (gpt-oss's also as vLLM spells it, openai_gptoss): name -> (module, class)
BUILTIN: dict[str, tuple[str, str]] = {
    "deepseek_r1": ("parsers", "DeepSeekR1ReasoningParser"),
    "deepseek_v3": ("deepseek_v3", "DeepSeekV3ReasoningParser"),
    "ernie45": ("ernie45", "Ernie45ReasoningParser"),
    "glm45": ("glm45", "Glm45ReasoningParser"),
    "gpt_oss": ("gpt_oss", "GptOssReasoningParser"),
    "openai_gptoss": ("gpt_oss", "GptOssReasoningParser"),
    "granite": ("granite", "GraniteReasoningParser"),
    "hunyuan_a13b": ("hunyuan_a13b", "HunyuanA13BReasoningParser"),
    "mistral": ("mistral", "MistralReasoningParser"),
    "qwen3": ("parsers", "Qwen3ReasoningParser"),
}
for _name, (_module, _cls) in BUILTIN.items():
    ReasoningParserManager.register_lazy_module(_name, f"llmhal.reasoning.{_module}", _cls)
