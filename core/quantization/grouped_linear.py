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

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from llmhal.quantization.tracked_params import release

        parts = self.grouped_parts(layer)
        kernels = []
        for part in parts:
            if isinstance(part.weight, GroupedQuantWeight):
                kernel = make_kernel(part.weight, layer.params_dtype)
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
