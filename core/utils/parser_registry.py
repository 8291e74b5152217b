"""Name -> class registries for per-request output parsers (vLLM's ``ToolParserManager`` and
``ReasoningParserManager`` share this shape): built-ins registered lazily as (module, class),
out-of-tree classes registered lazily by a decorator or at once with ``module=``, and plugin files
imported by path so their classes can register themselves."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, ClassVar

from llmhal.logger import init_logger

logger = init_logger(__name__)


class ParserRegistry:
    """Subclasses set ``kind`` (e.g. "Tool parser"), ``base`` (the class every entry must
    subclass), ``plugin_package`` (where plugin files are imported) and their own two dicts."""

    kind: ClassVar[str] = "Parser"
    base: ClassVar[type] = object
    plugin_package: ClassVar[str] = "llmhal.parser_plugins"
    eager: ClassVar[dict[str, type]]
    lazy: ClassVar[dict[str, tuple[str, str]]]

    @classmethod
    def get(cls, name: str) -> Any:
        if name in cls.eager:
            return cls.eager[name]
        if name in cls.lazy:
            module_path, class_name = cls.lazy[name]
            found = getattr(importlib.import_module(module_path), class_name)
            if not (isinstance(found, type) and issubclass(found, cls.base)):
                raise TypeError(f"{module_path}.{class_name} ({cls.kind.lower()} {name!r}) is not a {cls.base.__name__} subclass")  # fmt: skip
            cls.eager[name] = found
            return found
        raise KeyError(f"{cls.kind} {name!r} not found. Available parsers: {', '.join(cls.list_registered())}")  # fmt: skip

    @classmethod
    def list_registered(cls) -> list[str]:
        return sorted(set(cls.eager) | set(cls.lazy))

    @classmethod
    def status(cls) -> list[dict[str, Any]]:
        """Each registered parser: {name, class_path, available, reasons} (``llmhal doctor``);
        a parser whose module fails to import is unavailable, with the error as its reason."""
        out = []
        for name in cls.list_registered():
            module_path, class_name = cls.lazy.get(name) or (cls.eager[name].__module__, cls.eager[name].__qualname__)  # fmt: skip
            try:
                cls.get(name)
                reasons: list[str] = []
            except Exception as e:  # a plugin's broken module is a row, not a crash
                reasons = [f"{type(e).__name__}: {e}"]
            out.append({"name": name, "class_path": f"{module_path}:{class_name}", "available": not reasons, "reasons": reasons})  # fmt: skip
        return out

    @classmethod
    def register_lazy_module(cls, name: str, module_path: str, class_name: str) -> None:
        cls.lazy[name] = (module_path, class_name)

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
            if not force and (n in cls.eager or n in cls.lazy):
                raise KeyError(f"{n} is already registered")

        if module is not None:
            if not (isinstance(module, type) and issubclass(module, cls.base)):
                raise TypeError(f"{module!r} is not a {cls.base.__name__} subclass")
            for n in names_for(module):
                check(n)
                cls.eager[n] = module
            return module

        def deco(c: type) -> type:
            for n in names_for(c):
                check(n)
                cls.lazy[n] = (c.__module__, c.__qualname__)
            return c

        return deco

    @classmethod
    def import_plugin(cls, path: str) -> None:
        """Import a plugin, whose classes register themselves (a failure is logged): a Python
        file by its path, or an importable module by its dotted name (``my_pkg.parsers``)."""
        file = Path(path)
        if not file.is_file() and path.replace(".", "").replace("_", "").isalnum():
            try:
                importlib.import_module(path)
            except Exception:
                logger.exception("Could not import the %s plugin module %s (not a file either)", cls.kind.lower(), path)  # fmt: skip
            return
        name = f"{cls.plugin_package}.{file.stem}"
        try:
            spec = importlib.util.spec_from_file_location(name, file)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {file}")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        except Exception:
            logger.exception("Could not import the %s plugin %s", cls.kind.lower(), path)
