"""Lazy imports: class paths, optional libraries, and errors that name what to install."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any


class MissingDependencyError(ImportError):
    """An optional library is needed for what was asked; the message names the package to install."""


def split_qualname(path: str) -> tuple[str, str]:
    """Split ``"pkg.mod:Class"`` or ``"pkg.mod.Class"`` into (module, attribute path)."""
    if ":" in path:
        module, _, attr = path.partition(":")
    else:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError(
            f"{path!r} is not a class path: expected 'package.module:Name' or 'package.module.Name'"
        )
    return module, attr


def resolve_obj_by_qualname(path: str) -> Any:
    """Import the module of ``path`` and return the named object (dotted attributes allowed after ':')."""
    module_name, attr = split_qualname(path)
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(
                f"module {module_name!r} has no attribute {attr!r} (from {path!r})"
            ) from None
    return obj


def is_available(module: str) -> bool:
    """True when ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def not_installed(module: str, package: str) -> str:
    """The availability reason for a missing optional library, naming what to install."""
    return f"{module} is not installed (pip install {package})"


def require(module: str, *, package: str | None = None, purpose: str = "") -> Any:
    """Import an optional library, or raise an error that names the package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pkg = package or module
        what = f" for {purpose}" if purpose else ""
        raise MissingDependencyError(
            f"The optional library {module!r} is needed{what} but could not be imported ({e}). "
            f"Install it with: pip install {pkg}"
        ) from e


def api_missing(module: str, attrs: tuple[str, ...], package: str) -> str | None:
    """Why ``module``'s entry points ``attrs`` cannot be called (None: they can).

    Finding the module is not enough: another distribution may own the import name (PyPI's
    ``aiter`` is an asyncio helper), a namespace package may hold only a newer generation
    (flash-attn-4 installs ``flash_attn/cute`` without ``flash_attn_varlen_func``), and a compiled
    library built for another torch fails to import. So the module is imported and the attributes
    are looked up; the reason names what was found and ``package``, what to install.
    """
    if not is_available(module):
        return not_installed(module, package)
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # undefined symbols, missing CUDA libraries, ...
        return (
            f"{module} is installed but cannot be imported ({type(e).__name__}: {e}); "
            f"reinstall {package} built for this torch"
        )
    missing = [a for a in attrs if _lookup(mod, a) is None]
    if not missing:
        return None
    where = getattr(mod, "__file__", None) or ", ".join(getattr(mod, "__path__", []) or ["?"])
    kind = "a namespace package" if getattr(mod, "__file__", None) is None else "installed"
    return (
        f"{module} ({kind} at {where}) has no {', '.join(missing)}: another package owns the "
        f"name or the build lacks that API (pip install {package})"
    )


def _lookup(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj
