"""Qwen3-MoE: the Qwen3 decoder (per-head q/k norm) with sparse MoE blocks.

Layers listed in ``mlp_only_layers``, or off the ``decoder_sparse_step`` stride, keep a dense MLP of
``intermediate_size``; the others route each token to ``num_experts_per_tok`` of ``num_experts``
experts of width ``moe_intermediate_size`` by softmax, renormalized when ``norm_topk_prob``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from llmhal.models.moe import MoeForCausalLM, SparseMoeBlock, num_experts


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` is a MoE layer (the Qwen-MoE rule)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and num_experts(config) > 0
        and (layer_idx + 1) % step == 0
    )


def qwen_moe_args(config: Any) -> dict[str, Any]:
    """The sparse block's routing and expert sizes from a Qwen-MoE config."""
    return {
        "top_k": config.num_experts_per_tok,
        "intermediate_size": config.moe_intermediate_size,
        "renormalize": bool(getattr(config, "norm_topk_prob", False)),
        "activation": config.hidden_act,
    }


class QwenMoeForCausalLM(MoeForCausalLM):
    """Which layers are sparse, and their block, as the Qwen-MoE family defines them."""

    @classmethod
    def sparse_block(cls, config: Any, prefix: str) -> nn.Module:
        return SparseMoeBlock(
            config.hidden_size, num_experts(config), prefix, **qwen_moe_args(config)
        )

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return cls.dense_mlp(config, prefix)
        return cls.sparse_block(config, prefix)


class Qwen3MoeForCausalLM(QwenMoeForCausalLM):
    qk_norm = True
    supports_sliding_window = True
