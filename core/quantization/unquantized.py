"""The default method: weights in the model dtype, ``torch.nn.functional.linear``."""

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

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)

    def describe(self, layer: nn.Module) -> str:
        return f"unquantized {str(layer.weight.dtype).removeprefix('torch.')}"
