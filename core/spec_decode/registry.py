"""Speculative-decoding methods by name: ``method`` in the speculative config picks a
:class:`~llmhal.spec_decode.proposer.Proposer` class.

Entries are class-path strings, imported on first use. Out-of-tree methods register from a general
plugin (``vllm.general_plugins``), which the engine loads before it reads the speculative config::

    def register():
        from llmhal.spec_decode import register_proposer
        register_proposer("myspec", "my_pkg.proposer:MyProposer")
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from llmhal.logger import init_logger

logger = init_logger(__name__)

BUILTIN_PROPOSERS: dict[str, str] = {
    "ngram": "llmhal.spec_decode.ngram:NgramProposer",
    "suffix": "llmhal.spec_decode.suffix:SuffixProposer",
    "draft_model": "llmhal.spec_decode.draft_model:DraftModelProposer",
    "eagle": "llmhal.spec_decode.eagle:EagleProposer",
    "eagle3": "llmhal.spec_decode.eagle3:Eagle3Proposer",
    "dflash": "llmhal.spec_decode.dflash:DFlashProposer",
    "medusa": "llmhal.spec_decode.medusa:MedusaProposer",
    "mtp": "llmhal.spec_decode.mtp:MTPProposer",
}
# vLLM's other methods: named so a config asking for one is told it is not there yet, not that the
# name is unknown.
NOT_YET_AVAILABLE = ("mlp_speculator",)

_registered: dict[str, str] = {}
_classes: dict[str, type] = {}
_lock = threading.Lock()


def register_proposer(name: str, proposer: str | type) -> None:
    """Register (or override) the proposer for method ``name``: ``"pkg.mod:Class"`` (or
    ``"pkg.mod.Class"``) naming a Proposer subclass, imported on first use, or the class itself.
    The last registration of a name wins; overriding a built-in is logged."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a proposer's method name is a non-empty str, got {name!r}")
    if isinstance(proposer, type):
        _check_class(name, proposer, repr(proposer))
        class_path = f"{proposer.__module__}:{proposer.__qualname__}"
    elif isinstance(proposer, str) and proposer:
        class_path = proposer
    else:
        raise TypeError(f"register_proposer takes a 'pkg.mod:Class' path or a class, got {proposer!r}")  # fmt: skip
    key = name.lower()
    with _lock:
        if key in BUILTIN_PROPOSERS or key in _registered:
            logger.info("Speculative-decoding method %r is overridden by %s", key, class_path)
        _registered[key] = class_path
        _classes.pop(key, None)
        if isinstance(proposer, type):
            _classes[key] = proposer


def available_methods() -> list[str]:
    return sorted(set(BUILTIN_PROPOSERS) | set(_registered))


def class_path_of(method: str) -> str:
    """The registered class path of ``method``; ValueError naming the available ones."""
    key = method.lower()
    path = _registered.get(key) or BUILTIN_PROPOSERS.get(key)
    if path is not None:
        return path
    if key in NOT_YET_AVAILABLE:
        raise ValueError(
            f"speculative method {method!r} is not implemented in llmhal yet; available: "
            f"{', '.join(available_methods())} (or register your own with "
            "llmhal.spec_decode.register_proposer)"
        )
    raise ValueError(
        f"unknown speculative method {method!r}; available: {', '.join(available_methods())}. "
        "An out-of-tree method registers from a general plugin with "
        "llmhal.spec_decode.register_proposer(name, 'pkg.mod:Class')"
    )


def get_proposer_cls(method: str) -> type:
    """The Proposer subclass for ``method`` (imported once)."""
    key = method.lower()
    if key in _classes:
        return _classes[key]
    path = class_path_of(method)
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        cls: Any = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"speculative method {method!r} is registered as {path}, which cannot be imported: {e}"
        ) from e
    _check_class(method, cls, path)
    with _lock:
        _classes[key] = cls
    return cls


def _check_class(method: str, cls: Any, where: str) -> None:
    from llmhal.spec_decode.proposer import Proposer

    if not (isinstance(cls, type) and issubclass(cls, Proposer)):
        raise TypeError(
            f"speculative method {method!r} is registered as {where}, which is not a subclass of "
            "llmhal.spec_decode.Proposer"
        )


def _reset_for_tests() -> None:
    with _lock:
        _registered.clear()
        _classes.clear()
