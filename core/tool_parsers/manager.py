"""Tool-call parsers by name (vLLM's ``ToolParserManager``): built-ins registered lazily as class
paths, out-of-tree ones with :meth:`ToolParserManager.register_module` (a decorator registers the
class lazily; ``module=`` registers it at once) or from a file with
:meth:`ToolParserManager.import_tool_parser` (``llmhal serve --tool-parser-plugin PATH``)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, ClassVar

from llmhal.logger import init_logger
from llmhal.tool_parsers.base import ToolParser

logger = init_logger(__name__)


class ToolParserManager:
    tool_parsers: ClassVar[dict[str, type[ToolParser]]] = {}
    lazy_parsers: ClassVar[dict[str, tuple[str, str]]] = {}

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name in cls.tool_parsers:
            return cls.tool_parsers[name]
        if name in cls.lazy_parsers:
            module_path, class_name = cls.lazy_parsers[name]
            parser = getattr(importlib.import_module(module_path), class_name)
            if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
                raise TypeError(f"{module_path}.{class_name} (tool parser {name!r}) is not a ToolParser subclass")  # fmt: skip
            cls.tool_parsers[name] = parser
            return parser
        raise KeyError(
            f"Tool parser {name!r} not found. Available parsers: {', '.join(cls.list_registered())}"
        )

    @classmethod
    def list_registered(cls) -> list[str]:
        return sorted(set(cls.tool_parsers) | set(cls.lazy_parsers))

    @classmethod
    def register_lazy_module(cls, name: str, module_path: str, class_name: str) -> None:
        cls.lazy_parsers[name] = (module_path, class_name)

    @classmethod
    def register_module(
        cls, name: str | list[str] | None = None, force: bool = True, module: type | None = None
    ) -> Any:
        """Register ``module`` now under ``name`` (default: its class name), or, used as a
        decorator, the decorated class lazily (by its module path). ``force=False`` refuses a name
        already taken."""
        if not isinstance(force, bool):
            raise TypeError(f"force must be a bool, got {force!r}")

        def names_for(c: type) -> list[str]:
            return [name] if isinstance(name, str) else list(name or [c.__name__])

        def check(n: str) -> None:
            if not force and (n in cls.tool_parsers or n in cls.lazy_parsers):
                raise KeyError(f"{n} is already registered")

        if module is not None:
            if not (isinstance(module, type) and issubclass(module, ToolParser)):
                raise TypeError(f"{module!r} is not a ToolParser subclass")
            for n in names_for(module):
                check(n)
                cls.tool_parsers[n] = module
            return module

        def deco(c: type) -> type:
            for n in names_for(c):
                check(n)
                cls.lazy_parsers[n] = (c.__module__, c.__qualname__)
            return c

        return deco

    @classmethod
    def import_tool_parser(cls, path: str) -> None:
        """Import a parser plugin file, whose classes register themselves (a failure is logged)."""
        file = Path(path)
        name = f"llmhal.tool_parsers.plugins.{file.stem}"
        try:
            spec = importlib.util.spec_from_file_location(name, file)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {file}")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        except Exception:
            logger.exception("Could not import the tool parser plugin %s", path)


ToolParserManager.register_lazy_module("hermes", "llmhal.tool_parsers.hermes", "HermesToolParser")
