"""Quantization method registry: name -> lazy config class path.

Built-in methods live in core (they run on every platform); a platform adds its own through
``Platform.quantization_methods``; out-of-tree code uses :func:`register_quantization_config`.
Listing imports no method module; :func:`get_quantization_config` imports one on demand.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, TypeVar

from llmhal.logger import init_logger

logger = init_logger(__name__)

CORE_METHODS: dict[str, str] = {
    "gguf": "llmhal.quantization.gguf:GGUFConfig",
    "fp8": "llmhal.quantization.fp8:Fp8Config",
    "compressed-tensors": "llmhal.quantization.compressed_tensors:CompressedTensorsConfig",
    "gptq": "llmhal.quantization.gptq:GPTQConfig",
    "awq": "llmhal.quantization.awq:AWQConfig",
    "bitsandbytes": "llmhal.quantization.bitsandbytes:BitsAndBytesConfig",
    "experts_int8": "llmhal.quantization.experts_int8:ExpertsInt8Config",
}

CORE = "core"
REGISTERED = "registered"


@dataclass(frozen=True)
class MethodEntry:
    name: str
    class_path: str
    provider: str  # "core", a platform name, or "registered"


_lock = threading.Lock()
_registered: dict[str, MethodEntry] = {}
_registered_classes: dict[str, type] = {}

T = TypeVar("T", bound=type)


def register_quantization_config(name: str) -> Any:
    """Class decorator registering an out-of-tree :class:`QuantizationConfig` under ``name``.

    A class that is not a QuantizationConfig subclass is rejected; re-registering a name warns and
    replaces the earlier one.
    """

    def deco(cls: T) -> T:
        from llmhal.quantization.base import QuantizationConfig

        if not (isinstance(cls, type) and issubclass(cls, QuantizationConfig)):
            raise TypeError(
                f"register_quantization_config({name!r}) got {cls!r}: the class must subclass "
                f"llmhal.quantization.QuantizationConfig"
            )
        _store(name, f"{cls.__module__}:{cls.__qualname__}")
        with _lock:
            _registered_classes[name] = cls
        return cls

    return deco


def register_quantization_config_path(name: str, class_path: str) -> None:
    """Register a method by class path without importing it (used by plugin hooks)."""
    _store(name, class_path)


def _store(name: str, path: str) -> None:
    with _lock:
        if name in _registered or name in CORE_METHODS:
            logger.warning(
                "The quantization method %r already exists and is replaced by %s", name, path
            )
        _registered[name] = MethodEntry(name, path, REGISTERED)
        _registered_classes.pop(name, None)


def _platform_entries() -> list[MethodEntry]:
    from llmhal.platforms import get_current_platform
    from llmhal.platforms.resolver import declared_platform_classes
    from llmhal.utils.imports import resolve_obj_by_qualname

    active = get_current_platform()
    out = [MethodEntry(n, p, active.name) for n, p in active.quantization_methods.items()]
    for entry_name, path in declared_platform_classes().items():
        if entry_name == active.name:
            continue
        try:
            cls = resolve_obj_by_qualname(path)
        except Exception:
            continue
        pname = getattr(cls, "name", entry_name) or entry_name
        out += [
            MethodEntry(n, p, pname) for n, p in getattr(cls, "quantization_methods", {}).items()
        ]
    return out


def list_quantization_methods() -> list[MethodEntry]:
    """Every known method, without importing any method module."""
    from llmhal.platforms import get_current_platform

    active = get_current_platform().name
    entries = {n: MethodEntry(n, p, CORE) for n, p in CORE_METHODS.items()}
    for e in _platform_entries():
        cur = entries.get(e.name)
        if cur is None or (e.provider == active and cur.provider != active):
            entries[e.name] = e
    with _lock:
        entries.update(_registered)
    return list(entries.values())


def get_method_entry(name: str) -> MethodEntry | None:
    return next((e for e in list_quantization_methods() if e.name == name), None)


def get_quantization_config(name: str) -> type:
    """The config class registered as ``name``; unknown names list the registered ones."""
    from llmhal.utils.imports import resolve_obj_by_qualname

    with _lock:
        if name in _registered_classes:
            return _registered_classes[name]
    entry = get_method_entry(name)
    if entry is None:
        known = ", ".join(sorted(e.name for e in list_quantization_methods()))
        raise ValueError(f"Unknown quantization method {name!r}. Registered methods: {known}")
    from llmhal.platforms import get_current_platform

    if entry.provider not in (CORE, REGISTERED, get_current_platform().name):
        raise ValueError(
            f"Quantization method {name!r} is provided by the {entry.provider} platform, which is not "
            f"active here (active: {get_current_platform().name})."
        )
    return resolve_obj_by_qualname(entry.class_path)


def _clear_registrations_for_tests() -> None:
    with _lock:
        _registered.clear()
        _registered_classes.clear()
