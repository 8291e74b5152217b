"""Base of the linear methods whose weights map onto the grouped int4/int8 form (``quant_linear``).

GPTQ, AWQ, bitsandbytes int8 and compressed-tensors' int weight-only schemes all store
``w = scale * q + offset`` per group of inputs; a subclass registers the checkpoint's tensors
(``create_weights``) and converts them into :class:`~llmhal.ops.quant_linear.GroupedQuantWeight`
parts (:meth:`GroupedLinearMethod.grouped_parts`). This base builds the platform's ``quant_linear``
kernel for each part once loading is done, frees the checkpoint tensors, and runs the kernels.

A part may carry an input permutation: GPTQ's act-order (``desc_act``) assigns input columns to
groups through ``g_idx`` rather than contiguously; sorting the columns by group makes the groups
contiguous again, and the activations are permuted the same way at each call
(``x[:, perm] @ W[:, perm].T == x @ W.T``). Merged layers whose shards disagree on that
permutation get one part (and kernel) per shard, their outputs concatenated.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmhal.ops.quant_linear import GroupedQuantWeight, NativeQuantLinear
from llmhal.quantization.base import QuantizeMethodBase


@dataclass(frozen=True)
class GroupedPart:
    """Output rows ``[start, start + weight.shape[0])`` of a layer, in grouped form."""

    weight: GroupedQuantWeight | torch.Tensor  # a dense tensor where the format has no exact map
    perm: torch.Tensor | None = None  # input permutation (int64 [K]) applied to activations


class DenseKernel:
    """A dequantized weight, for layouts that do not map onto the grouped form (kept rare)."""

    name = "dense"

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def add_zeros_and_scales(
    layer: nn.Module, loader: Any, k: int, n: int, group_size: int, pack: int
) -> None:
    """Register the per-group zero points and scales GPTQ and AWQ checkpoints both store:
    ``qzeros`` int32 [K/g, N/pack] (``pack`` zero points per word, along the outputs) and
    ``scales`` [K/g, N] (any float dtype, kept as float32)."""
    from llmhal.quantization.tracked_params import FLOAT_DTYPES, add_param

    add_param(layer, "qzeros", (k // group_size, n // pack), torch.int32, loader,
              dtypes=[torch.int32], input_dim=0, output_dim=1, packed_dim=1,
              packed_factor=pack)  # fmt: skip
    add_param(layer, "scales", (k // group_size, n), torch.float32, loader, dtypes=FLOAT_DTYPES,
              input_dim=0, output_dim=1)  # fmt: skip


def grouped_part(
    q: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group_size: int,
    bits: int,
    g_idx: torch.Tensor | None = None,
) -> GroupedPart:
    """A part from ``q`` [N, K] with per-group ``scale``/``offset`` [N, K/g], where input column
    ``k`` belongs to group ``g_idx[k]`` (None: ``k // g``, contiguous groups)."""
    if g_idx is None:
        return GroupedPart(GroupedQuantWeight(q.contiguous(), scale, offset, group_size, bits))
    counts = torch.bincount(g_idx, minlength=scale.shape[1])
    if bool((counts == group_size).all()):
        perm = torch.argsort(g_idx, stable=True)
        w = GroupedQuantWeight(
            q.index_select(1, perm).contiguous(), scale, offset, group_size, bits
        )
        return GroupedPart(w, perm)
    # Groups of unequal size: exact, but only as a dense weight.
    dense = q.to(torch.float32) * scale.index_select(1, g_idx)
    if offset is not None:
        dense = dense + offset.index_select(1, g_idx)
    return GroupedPart(dense)


def stashed_g_idx(layer: nn.Module, name: str, group_size: int) -> dict[Any, torch.Tensor]:
    """Shard id -> the group index of each input column, from a stash parameter ``name``."""
    from llmhal.layers.weights import WeightLoadError
    from llmhal.quantization.tracked_params import expect_shape, layer_name, shard_ids, stashed

    k = layer.input_size
    groups = k // group_size
    # A row-parallel rank's groups are numbered from its first one (``g_idx_base``, set by the
    # method when it creates the rank's weights).
    base = getattr(layer, "g_idx_base", 0)
    out = {}
    for sid, gi in stashed(layer, name).items():
        expect_shape(layer, name, sid, gi, (k,))
        gi = gi.to(torch.int64) - base
        if gi.numel() and (int(gi.min()) < 0 or int(gi.max()) >= groups):
            split = (
                " (this tensor-parallel rank's input columns belong to other ranks' groups: "
                "an act-order checkpoint cannot be split along its inputs; use "
                "tensor_parallel_size=1 or a checkpoint without desc_act)"
                if base or getattr(layer, "tp_size", 1) > 1
                else ""
            )
            raise WeightLoadError(
                f"{layer_name(layer)}.{name}: group indices must lie in [0, {groups}), got "
                f"[{int(gi.min())}, {int(gi.max())}]{split}"
            )
        out[sid] = gi
    if None in out:  # loaded without a shard id into a merged layer: it serves every shard
        whole = out.pop(None)
        out = {sid: out.get(sid, whole) for sid in shard_ids(layer)}
    return out


def act_order_parts(
    layer: nn.Module,
    q: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group_size: int,
    bits: int,
    g_idx: dict[Any, torch.Tensor],
) -> list[GroupedPart]:
    """Parts for a layer whose shards each have a ``g_idx``: one part when they agree (the usual
    case: q/k/v see the same input, so act-order gives them the same order), else one per shard."""
    from llmhal.quantization.tracked_params import shard_slices

    trivial = torch.arange(layer.input_size, device=q.device) // group_size
    g_idx = {sid: gi.to(q.device) for sid, gi in g_idx.items()}
    perms = {sid: None if torch.equal(gi, trivial) else gi for sid, gi in g_idx.items()}
    distinct = {None if p is None else tuple(p.tolist()) for p in perms.values()}
    if len(distinct) == 1:
        return [grouped_part(q, scale, offset, group_size, bits, next(iter(perms.values())))]
    parts = []
    for sid, (start, size) in shard_slices(layer).items():
        rows = slice(start, start + size)
        off = None if offset is None else offset[rows]
        parts.append(grouped_part(q[rows], scale[rows], off, group_size, bits, perms[sid]))
    return parts


def make_kernel(weight: GroupedQuantWeight, act_dtype: torch.dtype) -> Any:
    """The platform's ``quant_linear`` kernel for ``weight`` (core's native one if it declines)."""
    from llmhal.ops.registry import get_op

    cls = get_op("quant_linear")
    supports = getattr(cls, "supports", None)
    if supports is not None and supports(weight, act_dtype) is not None:
        cls = NativeQuantLinear
    return cls(weight, act_dtype)


class GroupedLinearMethod(QuantizeMethodBase):
    """Subclasses: ``create_weights``, :meth:`grouped_parts`, :attr:`checkpoint_params`."""

    method_name = "grouped"

    @property
    @abstractmethod
    def checkpoint_params(self) -> list[str]:
        """Names of the parameters ``create_weights`` registers (freed once repacked)."""

    @abstractmethod
    def grouped_parts(self, layer: nn.Module) -> list[GroupedPart]:
        """The loaded weight as parts covering the outputs in order; raise naming missing tensors."""

    def kernel_for(self, weight: GroupedQuantWeight, act_dtype: torch.dtype) -> Any:
        """The kernel object for one part (default: the platform's ``quant_linear``)."""
        return make_kernel(weight, act_dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from llmhal.quantization.tracked_params import release

        parts = self.grouped_parts(layer)
        kernels = []
        for part in parts:
            if isinstance(part.weight, GroupedQuantWeight):
                kernel = self.kernel_for(part.weight, layer.params_dtype)
            else:
                kernel = DenseKernel(part.weight.to(layer.params_dtype))
            kernels.append((kernel, part.perm))
        layer.quant_kernels = kernels
        release(layer, self.checkpoint_params)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        kernels = layer.quant_kernels
        if len(kernels) == 1:
            kernel, perm = kernels[0]
            return kernel(x if perm is None else x.index_select(-1, perm), bias)
        outs = [k(x if p is None else x.index_select(-1, p)) for k, p in kernels]
        y = torch.cat(outs, dim=-1)
        return y if bias is None else y + bias.to(y.dtype)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        kernels = layer.quant_kernels
        if len(kernels) == 1 and kernels[0][1] is None and hasattr(kernels[0][0], "embedding"):
            return kernels[0][0].embedding(ids)
        raise NotImplementedError(
            f"{layer.prefix}: {self.method_name} does not support embedding lookup for this layout"
        )

    def weight_bytes(self, layer: nn.Module) -> int:
        total = super().weight_bytes(layer)  # bias, and any parameters not yet released
        for kernel, perm in getattr(layer, "quant_kernels", []):
            total += kernel.weight_bytes()
            if perm is not None:
                total += perm.numel() * perm.element_size()
        return total

    def describe(self, layer: nn.Module) -> str:
        kernels = getattr(layer, "quant_kernels", None)
        if not kernels:
            return f"{self.method_name} (not loaded)"
        names = sorted({getattr(k, "name", type(k).__name__) for k, _ in kernels})
        perm = " act-order" if any(p is not None for _, p in kernels) else ""
        return f"{self.method_name}{perm} -> {'+'.join(names)}"
