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


ToolParserManager.register_lazy_module("hermes", "llmhal.tool_parsers.hermes", "HermesToolParser")
