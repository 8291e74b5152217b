"""Token embeddings and the LM head, both quantization-aware (a GGUF file may quantize them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmhal.layers.linear import _current_quant_and_dtype
from llmhal.layers.weights import sharded_weight_loader
from llmhal.quantization.base import QuantizationConfig, QuantizeMethodBase
from llmhal.quantization.unquantized import UnquantizedLinearMethod


class VocabEmbedding(nn.Module):
    """``weight`` is [num_embeddings, embedding_dim]; ``forward(ids)`` looks rows up, and
    ``logits(hidden)`` multiplies by the transposed table (the LM head, tied or not)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        quant_config: QuantizationConfig | None = None,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        q, dt = _current_quant_and_dtype()
        quant_config = quant_config if quant_config is not None else q
        params_dtype = params_dtype or dt
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.params_dtype = params_dtype
        self.input_size = embedding_dim
        self.output_sizes = [num_embeddings]
        method: QuantizeMethodBase | None = None
        if quant_config is not None:
            method = quant_config.get_quant_method(self, prefix)
        self.quant_method: QuantizeMethodBase = method or UnquantizedLinearMethod()
        loader = sharded_weight_loader([0], [num_embeddings], [0])
        self.quant_method.create_weights(
            self, embedding_dim, [num_embeddings], params_dtype, weight_loader=loader
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.quant_method.embedding(self, ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, hidden, None)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}x{self.embedding_dim}, method={type(self.quant_method).__name__}"
        )


class ParallelLMHead(VocabEmbedding):
    """An untied LM head (same storage rules as the embedding table)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, **kw: Any) -> None:
        super().__init__(num_embeddings, embedding_dim, **kw)
