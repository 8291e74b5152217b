"""Qwen2-MoE: the Qwen2 decoder (biased q/k/v) whose sparse blocks add a shared expert.

The shared expert is a dense gated MLP of ``shared_expert_intermediate_size`` that every token
uses, scaled by ``sigmoid(shared_expert_gate(x))``, added to the routed experts' sum. Which layers are
sparse follows the Qwen-MoE rule (:func:`llmhal.models.qwen3_moe.is_sparse_layer`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmhal.layers.fused_moe import RouterLinear
from llmhal.models.moe import MoeForCausalLM, SparseMoeBlock, num_experts
from llmhal.models.qwen3_moe import QwenMoeForCausalLM, qwen_moe_args


class Qwen2MoeSparseBlock(SparseMoeBlock):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__(config.hidden_size, num_experts(config), prefix, **qwen_moe_args(config))
        self.shared_expert = MoeForCausalLM.dense_mlp(
            config, f"{prefix}.shared_expert", config.shared_expert_intermediate_size
        )
        self.shared_expert_gate = RouterLinear(
            config.hidden_size, 1, prefix=f"{prefix}.shared_expert_gate"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # shared_expert(x) * sigmoid(shared_expert_gate(x)) is added by the MoE op (one native
        # call with the routed experts where the platform's op takes it).
        return self.experts(
            x, self.gate(x), shared_output=self.shared_expert(x),
            shared_gate=self.shared_expert_gate(x),
        )  # fmt: skip


class Qwen2MoeForCausalLM(QwenMoeForCausalLM):
    qkv_bias_attr = "qkv_bias"
    o_bias_attr = None
    supports_sliding_window = True

    @classmethod
    def sparse_block(cls, config: Any, prefix: str) -> nn.Module:
        if getattr(config, "shared_expert_intermediate_size", 0):
            return Qwen2MoeSparseBlock(config, prefix)
        return super().sparse_block(config, prefix)
