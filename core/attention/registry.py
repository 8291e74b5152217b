"""Attention backend registry: name -> lazy class path, with who provides it.

Sources, later ones overriding earlier ones of the same name:

1. core's hardware-neutral backends (``flex_attention``, ``triton_attn``, ``tree_attn``, ``reference``,
   the MLA ones ``torch_mla``, ``reference_mla`` and ``triton_mla``, and the recurrent kinds'
   ``mamba1_attn``, ``mamba2_attn``, ...);
2. every installed platform's declared backends (the active platform's are usable; an inactive one's
   are listed so errors and ``llmhal doctor`` can say which platform provides them);
3. :func:`register_attention_backend`, for out-of-tree code.

Names are case-insensitive (``FLASH_ATTN`` == ``flash_attn``). Listing imports no backend module.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from llmhal.logger import init_logger

logger = init_logger(__name__)

# name -> (class path, kind)
CORE_BACKENDS: dict[str, tuple[str, str]] = {
    "flex_attention": ("llmhal.attention.flex_attention:FlexAttentionBackend", "mha"),
    "triton_attn": ("llmhal.attention.triton_attn:TritonAttentionBackend", "mha"),
    "tree_attn": ("llmhal.attention.tree_attn:TreeAttentionBackend", "tree"),
    "reference": ("llmhal.attention.reference:ReferenceAttentionBackend", "mha"),
    # MLA (DeepSeek), latent KV cache: the batched one first, the one an unranked platform picks.
    "torch_mla": ("llmhal.attention.mla.torch_mla:TorchMLABackend", "mla"),
    "reference_mla": ("llmhal.attention.mla.reference:ReferenceMLABackend", "mla"),
    "triton_mla": ("llmhal.attention.mla.triton_mla:TritonMLABackend", "mla"),
    # Recurrent kinds (see llmhal.attention.state): metadata builders for state-keeping layers.
    "mamba1_attn": ("llmhal.attention.mamba1_attn:Mamba1AttentionBackend", "mamba1"),
    "mamba2_attn": ("llmhal.attention.mamba2_attn:Mamba2AttentionBackend", "mamba2"),
    "short_conv_attn": ("llmhal.attention.short_conv_attn:ShortConvAttentionBackend", "short_conv"),
    "linear_attn": ("llmhal.attention.linear_attn:LinearAttentionBackend", "linear"),
}

CORE = "core"
REGISTERED = "registered"


@dataclass(frozen=True)
class BackendEntry:
    """One known backend. ``provider`` is "core", a platform name, or "registered"."""

    name: str
    class_path: str
    provider: str
    kind: str | None = None  # known without import when registered with it

    @property
    def is_core(self) -> bool:
        return self.provider == CORE


_lock = threading.Lock()
_registered: dict[str, BackendEntry] = {}
_classes: dict[str, type] = {}

T = TypeVar("T", bound=type)


def normalize(name: str) -> str:
    return name.strip().lower()


def register_attention_backend(
    name: str, class_path: str | None = None, *, kind: str | None = None
) -> Any:
    """Register (or override) a backend. Also usable as a class decorator without ``class_path``.

    The last registration of a name wins. Overriding a built-in name is logged.
    """
    key = normalize(name)

    def _store(path: str) -> None:
        with _lock:
            if key in _registered or key in CORE_BACKENDS:
                logger.info("Attention backend %r is overridden by %s", key, path)
            _registered[key] = BackendEntry(key, path, REGISTERED, kind)
            _classes.pop(key, None)

    if class_path is not None:
        _store(class_path)
        return lambda cls: cls

    def deco(cls: T) -> T:
        _store(f"{cls.__module__}:{cls.__qualname__}")
        return cls

    return deco


def _platform_entries() -> list[BackendEntry]:
    """Backends declared by installed platforms: the active one first, then inactive ones."""
    from llmhal.platforms import get_current_platform
    from llmhal.platforms.resolver import declared_platform_classes
    from llmhal.utils.imports import resolve_obj_by_qualname

    active = get_current_platform()
    out = [BackendEntry(normalize(n), p, active.name) for n, p in active.attention_backends.items()]
    for entry_name, path in declared_platform_classes().items():
        if entry_name == active.name:
            continue
        try:
            cls = resolve_obj_by_qualname(path)
        except Exception as e:  # an inactive platform that cannot even import: say so elsewhere
            logger.debug("Cannot read backends of platform %s (%s): %s", entry_name, path, e)
            continue
        for n, p in getattr(cls, "attention_backends", {}).items():
            out.append(
                BackendEntry(normalize(n), p, getattr(cls, "name", entry_name) or entry_name)
            )
    return out


def list_attention_backends() -> list[BackendEntry]:
    """Every known backend, without importing any backend module.

    When a name is provided by several sources, the active platform beats inactive ones, and an
    explicit registration beats both.
    """
    from llmhal.platforms import get_current_platform

    active = get_current_platform().name
    entries: dict[str, BackendEntry] = {
        n: BackendEntry(n, p, CORE, k) for n, (p, k) in CORE_BACKENDS.items()
    }
    for e in _platform_entries():
        cur = entries.get(e.name)
        if cur is None or cur.provider == CORE or e.provider == active:
            if cur is not None and cur.provider == active:
                continue
            entries[e.name] = e
    with _lock:
        entries.update(_registered)
    return list(entries.values())


def get_backend_entry(name: str) -> BackendEntry | None:
    key = normalize(name)
    for e in list_attention_backends():
        if e.name == key:
            return e
    return None


def is_usable_provider(entry: BackendEntry) -> bool:
    """Core and registered backends run anywhere they validate; platform ones on their platform."""
    from llmhal.platforms import get_current_platform

    return entry.provider in (CORE, REGISTERED) or entry.provider == get_current_platform().name


def load_backend_class(entry: BackendEntry) -> type:
    """Import (once) and return the backend class of ``entry``."""
    from llmhal.attention.backend import AttentionBackend
    from llmhal.utils.imports import resolve_obj_by_qualname

    with _lock:
        cached = _classes.get(entry.name)
    if cached is not None and f"{cached.__module__}:{cached.__qualname__}" == entry.class_path:
        return cached
    cls = resolve_obj_by_qualname(entry.class_path)
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(
            f"{entry.class_path} (attention backend {entry.name!r}) is not an AttentionBackend subclass"
        )
    with _lock:
        _classes[entry.name] = cls
    return cls


def _clear_registrations_for_tests(predicate: Callable[[str], bool] | None = None) -> None:
    with _lock:
        for k in [k for k in _registered if predicate is None or predicate(k)]:
            del _registered[k]
        _classes.clear()
