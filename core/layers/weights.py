"""The weight-loading protocol shared by layers and quantization methods.

Every parameter a quantization method creates carries attributes that tell the loader how a
checkpoint tensor maps onto it:

``weight_loader(param, loaded_weight, shard_id=None)``
    copies a checkpoint tensor (or one shard of a merged layer) into ``param``;
``output_dim`` / ``input_dim``
    which dimension of the stored tensor runs along the layer's outputs / inputs (None: neither);
``packed_dim`` / ``packed_factor``
    a dimension stored packed (e.g. 8 int4 values per int32): its extent is the logical extent
    divided by ``packed_factor``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class WeightLoadError(ValueError):
    """A checkpoint tensor does not fit the parameter it is loaded into."""


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any] | None) -> None:
    for key, value in (attrs or {}).items():
        if hasattr(param, key) and key != "weight_loader":
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def _shard_extent(param: torch.Tensor, offset: int, size: int) -> tuple[int, int]:
    if getattr(param, "packed_dim", None) is not None and param.packed_dim == param.output_dim:
        factor = param.packed_factor
        return offset // factor, size // factor
    return offset, size


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightLoadError(
            f"{what}: checkpoint shape {tuple(src.shape)} does not match expected {tuple(dst.shape)}"
        )
    dst.copy_(src.to(dst.dtype) if dst.dtype != src.dtype and not _is_raw(dst) else src)


def _is_raw(t: torch.Tensor) -> bool:
    return t.dtype in (torch.uint8, torch.int8, torch.int32, torch.int64)


def sharded_weight_loader(
    shard_offsets: Sequence[int], shard_sizes: Sequence[int], shard_names: Sequence[Any]
):
    """A loader for merged layers: shard ``shard_id`` occupies ``[offset, offset+size)`` of the outputs."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        out_dim = getattr(param, "output_dim", None)
        if shard_id is None or out_dim is None:
            copy_checked(param.data, loaded, "weight")
            return
        try:
            idx = list(shard_names).index(shard_id)
        except ValueError:
            raise WeightLoadError(
                f"unknown shard {shard_id!r}; this layer has shards {list(shard_names)}"
            ) from None
        start, size = _shard_extent(param, shard_offsets[idx], shard_sizes[idx])
        copy_checked(param.data.narrow(out_dim, start, size), loaded, f"shard {shard_id!r}")

    return load
