"""Token embeddings and the LM head, both quantization-aware (a GGUF file may quantize them), with
the vocabulary split across the tensor-parallel ranks.

Rank ``r`` of ``tp`` holds rows ``[r*P, (r+1)*P)`` of the table, ``P = ceil(vocab / tp)`` (the
last rank's missing rows are zeros). A lookup gives zeros for ids outside the rank's rows, and an
all-reduce sums the ranks' partial lookups; the LM head computes the rank's slice of the logits and
an all-gather joins them (every rank gets the full logits: the sampler may run on any of them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmhal.layers.linear import (
    _current_quant_and_dtype,
    check_tp_shardable,
    shard_parameters,
    tp_rank_and_size,
)
from llmhal.layers.weights import sharded_weight_loader
from llmhal.quantization.base import QuantizationConfig, QuantizeMethodBase
from llmhal.quantization.unquantized import UnquantizedLinearMethod


class VocabEmbedding(nn.Module):
    """``weight`` is [num_embeddings, embedding_dim] (this rank's rows); ``forward(ids)`` looks
    rows up, and ``logits(hidden)`` multiplies by the transposed table (the LM head, tied or
    not). ``num_embeddings`` is the model's vocabulary; ``num_embeddings_per_partition`` the
    rank's rows."""

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
        self.tp_rank, self.tp_size = tp_rank_and_size()
        per = -(-num_embeddings // self.tp_size)
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = per
        self.vocab_start = self.tp_rank * per
        self.vocab_end = min(self.vocab_start + per, num_embeddings)
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.params_dtype = params_dtype
        self.input_size = embedding_dim
        self.output_sizes = [per]
        method: QuantizeMethodBase | None = None
        if quant_config is not None:
            method = quant_config.get_quant_method(self, prefix)
        self.quant_method: QuantizeMethodBase = method or UnquantizedLinearMethod()
        check_tp_shardable(self, self.tp_size)
        loader = sharded_weight_loader([0], [per], [0])
        self.quant_method.create_weights(
            self, embedding_dim, [per], params_dtype, weight_loader=loader
        )
        if self.tp_size > 1:
            shard_parameters(
                self, "output_dim", lambda _s: (self.tp_rank, 1, self.tp_size), pad=True
            )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.embedding(self, ids)
        from llmhal.distributed.parallel_state import get_tp_group

        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, torch.zeros_like(ids))
        out = self.quant_method.embedding(self, local)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return get_tp_group().all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, hidden, None)
        if self.tp_size == 1:
            return out
        from llmhal.distributed.parallel_state import get_tp_group

        return get_tp_group().all_gather(out, dim=-1)[..., : self.num_embeddings]

    def extra_repr(self) -> str:
        part = (
            f" (rows {self.vocab_start}..{self.vocab_end} on rank {self.tp_rank})"
            if self.tp_size > 1
            else ""
        )
        return (
            f"{self.num_embeddings}x{self.embedding_dim}{part}, "
            f"method={type(self.quant_method).__name__}"
        )


class ParallelLMHead(VocabEmbedding):
    """An untied LM head (same storage and split as the embedding table)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, **kw: Any) -> None:
        super().__init__(num_embeddings, embedding_dim, **kw)


# vLLM's name for the split table.
VocabParallelEmbedding = VocabEmbedding
