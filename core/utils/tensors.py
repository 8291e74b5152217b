"""Finding the tensors inside nested containers (imports torch: not for cheap import paths)."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

import torch


def tensors_in(obj: Any, depth: int = 4) -> list[torch.Tensor]:
    """The tensors held by ``obj``: itself, or inside tuples, lists, dict values and dataclass
    fields, at most ``depth`` containers deep."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth <= 0:
        return []
    if isinstance(obj, tuple | list):
        items: Any = obj
    elif isinstance(obj, dict):
        items = obj.values()
    elif is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in fields(obj)]
    else:
        return []
    return [t for item in items for t in tensors_in(item, depth - 1)]
