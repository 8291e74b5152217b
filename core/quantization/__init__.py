"""Quantization: the contract, the registry, and the built-in methods (imported lazily)."""

from __future__ import annotations

from typing import Any

from llmhal.quantization.registry import (
    get_quantization_config,
    list_quantization_methods,
    register_quantization_config,
)

__all__ = [
    "QuantizationConfig",
    "QuantizeMethodBase",
    "get_quantization_config",
    "list_quantization_methods",
    "register_quantization_config",
]


def __getattr__(name: str) -> Any:
    if name in ("QuantizationConfig", "QuantizeMethodBase"):
        from llmhal.quantization import base

        return getattr(base, name)
    raise AttributeError(f"module 'llmhal.quantization' has no attribute {name!r}")
