"""Attention: the backend contract, the registry and the selector.

Importing this package is cheap; backends and torch load on first use. See ``backend.py`` for the
contract, ``registry.py`` for naming and registration, ``selector.py`` for the selection rules.
"""

from __future__ import annotations

from typing import Any

from llmhal.attention.registry import (
    BackendEntry,
    list_attention_backends,
    register_attention_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionBackendError",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "AttentionRequirements",
    "BackendEntry",
    "CommonAttentionMetadata",
    "MultipleOf",
    "list_attention_backends",
    "register_attention_backend",
    "select_attention_backend",
]

_LAZY = {
    "AttentionBackend": "llmhal.attention.backend",
    "AttentionImpl": "llmhal.attention.backend",
    "AttentionMetadataBuilder": "llmhal.attention.backend",
    "AttentionRequirements": "llmhal.attention.backend",
    "CommonAttentionMetadata": "llmhal.attention.backend",
    "MultipleOf": "llmhal.attention.backend",
    "AttentionBackendError": "llmhal.attention.selector",
    "select_attention_backend": "llmhal.attention.selector",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llmhal.attention' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
