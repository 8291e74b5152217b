"""Parameters for quantized checkpoints whose loading is tracked, so a missing tensor is caught.

A quantized layer has several checkpoint tensors per weight (``qweight``, ``scales``, ``qzeros``,
``weight_scale``, ...), and a merged layer (q/k/v, gate/up) receives each one once per shard. The
helpers here register such parameters with a ``weight_loader`` that records which shards arrived
and names the parameter in its errors; :func:`check_loaded` (called from a method's
``process_weights_after_loading``) then reports, by name and shard, any tensor the checkpoint
lacked, instead of computing with uninitialised memory.

Two kinds of parameter:

* :func:`add_param` - a tensor of known shape, copied in place through the layer's shard loader
  (``output_dim``/``packed_dim`` say where a shard goes, see :mod:`llmhal.layers.weights`).
* :func:`add_stash_param` - a tensor whose shape is only known from the checkpoint (a per-tensor
  *or* per-channel scale, a serialized quantization state): the loader keeps each shard's tensor
  as loaded, and the method assembles them in ``process_weights_after_loading``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from llmhal.layers.weights import WeightLoadError, set_weight_attrs

_LOADED = "_llmhal_loaded"  # layer attribute: param name -> set of shard ids (None = whole)
_STASH = "_llmhal_stash"  # layer attribute: param name -> {shard id: tensor}

Loader = Callable[..., None]

# Checkpoint dtypes accepted for float scales (converted to float32 when loaded).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def layer_name(layer: nn.Module) -> str:
    return getattr(layer, "prefix", "") or type(layer).__name__


def shard_ids(layer: nn.Module) -> list[Any]:
    """The layer's shard ids in output order (``[0]`` for a single-projection layer)."""
    return list(getattr(layer, "shard_names", None) or [0])


def shard_slices(layer: nn.Module) -> dict[Any, tuple[int, int]]:
    """Shard id -> (first output row, number of rows)."""
    out, start = {}, 0
    for sid, size in zip(shard_ids(layer), layer.output_sizes, strict=True):
        out[sid] = (start, size)
        start += size
    return out


def tensor_where(layer: nn.Module, name: str, shard_id: Any = None) -> str:
    """How errors name checkpoint tensor ``name`` of ``layer``: ``<layer>.<name>``, plus the shard
    when the layer has several and ``shard_id`` is one of them (None: the whole layer)."""
    multi = shard_id is not None and len(shard_ids(layer)) > 1
    return f"{layer_name(layer)}.{name}" + (f" shard {shard_id!r}" if multi else "")


def _record(layer: nn.Module, name: str, shard_id: Any) -> None:
    loaded = layer.__dict__.setdefault(_LOADED, {})
    loaded.setdefault(name, set()).add(shard_id)


def _check_shard_id(layer: nn.Module, name: str, shard_id: Any) -> None:
    if shard_id is not None and shard_id not in shard_ids(layer):
        raise WeightLoadError(
            f"{layer_name(layer)}.{name}: unknown shard {shard_id!r}; this layer has shards "
            f"{shard_ids(layer)}"
        )


def _tracked(
    layer: nn.Module, name: str, loader: Loader, dtypes: Sequence[torch.dtype] | None
) -> Loader:
    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        _check_shard_id(layer, name, shard_id)
        if dtypes is not None and loaded.dtype not in dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise WeightLoadError(
                f"{layer_name(layer)}.{name}: checkpoint dtype "
                f"{str(loaded.dtype).removeprefix('torch.')}, expected {allowed}"
            )
        try:
            loader(param, loaded, shard_id)
        except WeightLoadError as e:
            raise WeightLoadError(f"{layer_name(layer)}.{name}: {e}") from None
        _record(layer, name, shard_id)

    return load


def add_param(
    layer: nn.Module,
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    loader: Loader,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    **attrs: Any,
) -> nn.Parameter:
    """Register ``name`` on ``layer``, loaded through ``loader`` (usually the layer's shard loader).

    ``attrs`` are the loading-protocol attributes (``output_dim``, ``input_dim``, ``packed_dim``,
    ``packed_factor``). ``dtypes``: checkpoint dtypes accepted; others are an error naming the
    tensor (None: any dtype, converted on copy).
    """
    param = nn.Parameter(torch.zeros(tuple(shape), dtype=dtype), requires_grad=False)
    set_weight_attrs(param, {**attrs, "weight_loader": _tracked(layer, name, loader, dtypes)})
    layer.register_parameter(name, param)
    return param


def add_stash_param(
    layer: nn.Module, name: str, *, dtypes: Sequence[torch.dtype] | None = None
) -> nn.Parameter:
    """Register a placeholder ``name`` whose loader keeps each shard's checkpoint tensor as is.

    The tensors are read back with :func:`stashed`; the placeholder holds no memory.
    """

    def keep(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        stash = layer.__dict__.setdefault(_STASH, {}).setdefault(name, {})
        # A copy on the layer's device: the checkpoint tensor may be a view of a mapped file.
        stash[shard_id] = loaded.detach().to(param.device, copy=True)

    param = nn.Parameter(torch.empty(0), requires_grad=False)
    set_weight_attrs(param, {"weight_loader": _tracked(layer, name, keep, dtypes)})
    layer.register_parameter(name, param)
    return param


def stashed(layer: nn.Module, name: str) -> dict[Any, torch.Tensor]:
    """Shard id -> tensor loaded into a stash parameter; a whole-layer load is under every shard
    of a single-shard layer."""
    stash = dict(layer.__dict__.get(_STASH, {}).get(name, {}))
    if None in stash and len(shard_ids(layer)) == 1:
        stash[shard_ids(layer)[0]] = stash.pop(None)
    return stash


def shard_segments(layer: nn.Module, name: str) -> list[tuple[Any, torch.Tensor, int]]:
    """(shard id, stashed tensor, output rows) covering the layer's outputs in order.

    One entry per shard, or a single ``(None, tensor, output_size)`` when the checkpoint gave a
    merged layer one tensor for all its outputs. Call after :func:`check_loaded`.
    """
    tensors = stashed(layer, name)
    if None in tensors:
        return [(None, tensors[None], layer.output_size)]
    return [(sid, tensors[sid], size) for sid, (_start, size) in shard_slices(layer).items()]


def stashed_max(layer: nn.Module, name: str) -> float:
    """The largest value in any shard's stashed ``name``: the one static scale of a merged layer
    whose shards were calibrated separately (a larger scale only widens the range)."""
    return max(float(t.float().max()) for t in stashed(layer, name).values())


def missing(layer: nn.Module, names: Sequence[str]) -> list[str]:
    """Human-readable descriptions of the parameters in ``names`` that were not fully loaded."""
    loaded = layer.__dict__.get(_LOADED, {})
    out = []
    for name in names:
        got = loaded.get(name, set())
        if None in got:
            continue
        lacking = [s for s in shard_ids(layer) if s not in got]
        if not got:
            out.append(f"{layer_name(layer)}.{name} (never loaded)")
        elif lacking:
            out.append(
                f"{layer_name(layer)}.{name} (shards {[str(s) for s in lacking]} never loaded)"
            )
    return out


def check_loaded(layer: nn.Module, names: Sequence[str], method: str) -> None:
    """Raise :class:`WeightLoadError` naming every tensor in ``names`` the checkpoint did not give."""
    lacking = missing(layer, names)
    if lacking:
        raise WeightLoadError(
            f"{method} layer {layer_name(layer)}: the checkpoint lacks "
            + ", ".join(lacking)
            + ". The checkpoint is incomplete or was saved in another quantization format."
        )


def release(layer: nn.Module, names: Sequence[str]) -> None:
    """Drop the checkpoint-form parameters (and stashes) once repacked."""
    for name in names:
        if name in layer._parameters:
            del layer._parameters[name]
    stash = layer.__dict__.get(_STASH)
    if stash:
        for name in names:
            stash.pop(name, None)


def expect_shape(layer: nn.Module, name: str, shard: Any, t: torch.Tensor, shape: tuple) -> None:
    """Raise naming the tensor when a stashed shard tensor ``t`` does not have ``shape``."""
    if tuple(t.shape) != tuple(shape):
        raise WeightLoadError(
            f"{tensor_where(layer, name, shard)}: checkpoint shape {tuple(t.shape)} does not match "
            f"expected {tuple(shape)}"
        )
