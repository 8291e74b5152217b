"""The default method: weights in the model dtype, ``torch.nn.functional.linear``, or the platform's
``dense_linear`` kernel when it offers a faster form of the weight (:mod:`llmhal.ops.dense_linear`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmhal.layers.weights import set_weight_attrs
from llmhal.quantization.base import QuantizeMethodBase


class UnquantizedLinearMethod(QuantizeMethodBase):
    # Its checkpoint tensors split across tensor-parallel ranks (llmhal.layers.linear).
    tp_shardable = True

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False
        )
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1, **extra})
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # A vocabulary table's rows are looked up too (and a tied head shares them): kept as is.
        if hasattr(layer, "num_embeddings") or "weight" not in layer._parameters:
            return
        from llmhal.ops.registry import get_op

        kernel = get_op("dense_linear")(layer.weight.data)
        if kernel is not None:
            # The kernel holds the weight in its own layout; the parameter would be a second copy.
            layer.dense_kernel = kernel
            del layer._parameters["weight"]

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        kernel = layer.__dict__.get("dense_kernel")
        if kernel is not None:
            return kernel(x, bias)
        return F.linear(x, layer.weight, bias)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)

    def weight_bytes(self, layer: nn.Module) -> int:
        kernel = layer.__dict__.get("dense_kernel")
        return super().weight_bytes(layer) + (0 if kernel is None else kernel.weight_bytes())

    def describe(self, layer: nn.Module) -> str:
        kernel = layer.__dict__.get("dense_kernel")
        if kernel is not None:
            return f"unquantized -> {kernel.name}"
        return f"unquantized {str(layer.weight.dtype).removeprefix('torch.')}"
