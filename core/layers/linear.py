"""Quantization-aware linear layers.

No tensor parallelism: llmhal runs a model on one device, so the layers are replicated linears
that may merge several projections (q/k/v, gate/up) into one matmul. Each layer asks the engine's
quantization config for its method (by prefix); unquantized layers use ``UnquantizedLinearMethod``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import torch
from torch import nn

from llmhal.layers.weights import sharded_weight_loader
from llmhal.quantization.base import QuantizationConfig, QuantizeMethodBase
from llmhal.quantization.unquantized import UnquantizedLinearMethod


def _current_quant_and_dtype() -> tuple[QuantizationConfig | None, torch.dtype]:
    from llmhal.config import get_current_config

    cfg = get_current_config()
    return cfg.quant_config, cfg.model.dtype


def quant_and_dtype(
    quant_config: QuantizationConfig | None, params_dtype: torch.dtype | None
) -> tuple[QuantizationConfig | None, torch.dtype]:
    """The layer's quantization config and parameter dtype: the given ones, else the engine's."""
    if quant_config is None or params_dtype is None:
        q, dt = _current_quant_and_dtype()
        quant_config = quant_config if quant_config is not None else q
        params_dtype = params_dtype or dt
    return quant_config, params_dtype


class LinearBase(nn.Module):
    """``y = x @ W.T + b`` where ``W`` stacks ``output_sizes`` shards named ``shard_names``."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        bias: bool = False,
        shard_names: Sequence[Any] | None = None,
        quant_config: QuantizationConfig | None = None,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        quant_config, params_dtype = quant_and_dtype(quant_config, params_dtype)
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(self.output_sizes)
        self.shard_names = (
            list(shard_names) if shard_names is not None else list(range(len(self.output_sizes)))
        )
        self.prefix = prefix
        self.params_dtype = params_dtype
        offsets = [0, *accumulate(self.output_sizes)][:-1]
        loader = sharded_weight_loader(offsets, self.output_sizes, self.shard_names)
        method: QuantizeMethodBase | None = None
        if quant_config is not None:
            method = quant_config.get_quant_method(self, prefix)
        self.quant_method: QuantizeMethodBase = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(
            self, input_size, self.output_sizes, params_dtype, weight_loader=loader
        )
        if bias:
            b = nn.Parameter(torch.zeros(self.output_size, dtype=params_dtype), requires_grad=False)
            b.output_dim = 0
            b.weight_loader = loader
            self.register_parameter("bias", b)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, method={type(self.quant_method).__name__}"


class ReplicatedLinear(LinearBase):
    """A plain linear layer (one shard)."""

    def __init__(self, input_size: int, output_size: int, **kw: Any) -> None:
        super().__init__(input_size, [output_size], **kw)


class MergedLinear(LinearBase):
    """Several projections of the same input in one matmul, shards 0..n-1 (e.g. gate and up)."""


class QKVLinear(LinearBase):
    """The q, k and v projections in one matmul; shards "q", "k", "v"."""

    def __init__(
        self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, **kw: Any
    ) -> None:
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        sizes = [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size]
        super().__init__(hidden_size, sizes, shard_names=["q", "k", "v"], **kw)
