"""Mixtral: the Mistral decoder with a sparse MoE block (softmax top-k, renormalized) on every layer.

The published checkpoints name the block ``block_sparse_moe`` and the experts' projections
``w1`` (gate), ``w3`` (up), ``w2`` (down); transformers 5 names it ``mlp`` (and fuses the experts when
saving with ``save_original_format=False``). Both load: the block is ``mlp`` here.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from llmhal.models.moe import MoeForCausalLM, topk_moe_block


class MixtralForCausalLM(MoeForCausalLM):
    supports_sliding_window = True

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        return topk_moe_block(config, prefix, renormalize=True)

    def rename_checkpoint_tensor(self, name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.")
