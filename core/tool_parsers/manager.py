"""Tool-call parsers by name (vLLM's ``ToolParserManager``): built-ins registered lazily as class
paths, out-of-tree ones with :meth:`ToolParserManager.register_module` (a decorator registers the
class lazily; ``module=`` registers it at once) or from a file with
:meth:`ToolParserManager.import_tool_parser` (``llmhal serve --tool-parser-plugin PATH``)."""

from __future__ import annotations

from typing import ClassVar

from llmhal.tool_parsers.base import ToolParser
from llmhal.utils.parser_registry import ParserRegistry


class ToolParserManager(ParserRegistry):
    kind = "Tool parser"
    base = ToolParser
    plugin_package = "llmhal.tool_parsers.plugins"
    eager: ClassVar[dict[str, type]] = {}
    lazy: ClassVar[dict[str, tuple[str, str]]] = {}
    # vLLM's names for the two maps
    tool_parsers = eager
    lazy_parsers = lazy

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        return cls.get(name)

    @classmethod
    def import_tool_parser(cls, path: str) -> None:
        cls.import_plugin(path)


# vLLM's names; each family's parser in its own module of this package.
BUILTIN: dict[str, tuple[str, str]] = {
    "deepseek_v3": ("deepseek_v3", "DeepSeekV3ToolParser"),
    "deepseek_v31": ("deepseek_v31", "DeepSeekV31ToolParser"),
    "glm45": ("glm45", "Glm45ToolParser"),
    "glm47": ("glm45", "Glm45ToolParser"),  # GLM-4.7: the same tags, no newlines between them
    "granite": ("granite", "GraniteToolParser"),
    "hermes": ("hermes", "HermesToolParser"),
    "internlm": ("internlm", "InternLM2ToolParser"),
    "jamba": ("jamba", "JambaToolParser"),
    "kimi_k2": ("kimi_k2", "KimiK2ToolParser"),
    "llama3_json": ("llama3_json", "Llama3JsonToolParser"),
    "llama4_json": ("llama3_json", "Llama3JsonToolParser"),
    "llama4_pythonic": ("llama4_pythonic", "Llama4PythonicToolParser"),
    "mistral": ("mistral", "MistralToolParser"),
    "openai": ("openai", "OpenAIToolParser"),
    "phi4_mini_json": ("phi4_mini_json", "Phi4MiniJsonToolParser"),
    "pythonic": ("pythonic", "PythonicToolParser"),
    "qwen3_coder": ("qwen3_coder", "Qwen3CoderToolParser"),
    "xlam": ("xlam", "XLamToolParser"),
}
for _name, (_module, _cls) in BUILTIN.items():
    ToolParserManager.register_lazy_module(_name, f"llmhal.tool_parsers.{_module}", _cls)
