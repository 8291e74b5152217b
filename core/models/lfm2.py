"""LFM2 (Liquid AI): gated short convolutions on most layers, grouped-query attention with q/k
RMSNorms on a few (``layer_types``, or ``full_attn_idxs`` in older configs), a SwiGLU MLP on every
layer.

The convolution layers are recurrent layers of kind ``short_conv`` (state cache, backend
``short_conv_attn``); the attention layers use the paged KV cache and the platform's attention
backend. Published tensor names: ``conv.{in_proj,conv,out_proj}``, ``self_attn.{q,k,v,out}_proj``,
``self_attn.{q,k}_layernorm``, ``feed_forward.w1/w3/w2`` (gate/up/down), ``operator_norm``,
``ffn_norm``, and the final norm ``model.embedding_norm``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from llmhal.layers.activation import SiluAndMul
from llmhal.layers.layernorm import RMSNorm
from llmhal.layers.linear import MergedLinear, ReplicatedLinear
from llmhal.layers.rotary_embedding import RotaryEmbedding
from llmhal.layers.short_conv import ShortConv
from llmhal.models.hybrid import (
    HybridForCausalLM,
    PreNormDecoderLayer,
    SoftmaxAttention,
    join,
)
from llmhal.models.moe import SparseMoeBlock
from llmhal.models.utils import LLAMA_STACKED, StackedParam


def lfm2_intermediate_size(config: Any) -> int:
    """The MLP width: ``intermediate_size`` as given, or (``block_auto_adjust_ff_dim``) two thirds
    of it, times ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of`` -- as LFM2's
    published configs expect."""
    size = int(config.intermediate_size)
    if not getattr(config, "block_auto_adjust_ff_dim", False):
        return size
    size = int(2 * size / 3)
    multiplier = getattr(config, "block_ffn_dim_multiplier", None)
    if multiplier is not None:
        size = int(multiplier * size)
        step = int(config.block_multiple_of)
        size = step * ((size + step - 1) // step)
    return size


def lfm2_layer_types(config: Any) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    full = getattr(config, "full_attn_idxs", None)
    full = range(config.num_hidden_layers) if full is None else full
    return ["full_attention" if i in full else "conv" for i in range(config.num_hidden_layers)]


class Lfm2MLP(nn.Module):
    """SwiGLU with LFM2's names: ``w1`` gate and ``w3`` up (merged here as ``w13``), ``w2`` down."""

    def __init__(self, hidden_size: int, intermediate_size: int, prefix: str) -> None:
        super().__init__()
        sizes = [intermediate_size, intermediate_size]
        self.w13 = MergedLinear(hidden_size, sizes, prefix=join(prefix, "w13"))
        self.w2 = ReplicatedLinear(intermediate_size, hidden_size, prefix=join(prefix, "w2"))
        self.act = SiluAndMul()

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.act(self.w13(x)))


class Lfm2DecoderLayer(PreNormDecoderLayer):
    names = ("operator_norm", "ffn_norm", "feed_forward")

    def __init__(
        self, config: Any, rotary: RotaryEmbedding, layer_type: str, ffn: nn.Module, prefix: str
    ) -> None:
        super().__init__()
        eps = config.norm_eps
        if layer_type == "conv":
            self.conv = ShortConv(
                config.hidden_size, int(config.conv_L_cache), bias=bool(config.conv_bias),
                prefix=join(prefix, "conv"),
            )  # fmt: skip
        elif layer_type == "full_attention":
            self.self_attn = SoftmaxAttention(
                config, rotary, out_name="out_proj", qk_norm=("q_layernorm", "k_layernorm", eps),
                prefix=join(prefix, "self_attn"),
            )  # fmt: skip
        else:
            raise ValueError(
                f"LFM2 layer type {layer_type!r} is not supported; known: conv, full_attention"
            )
        self.is_attention = layer_type == "full_attention"
        self.operator_norm = RMSNorm(config.hidden_size, eps=eps)
        self.ffn_norm = RMSNorm(config.hidden_size, eps=eps)
        self.feed_forward = ffn

    def mix(self, positions: Tensor, hidden: Tensor) -> Tensor:
        return self.self_attn(positions, hidden) if self.is_attention else self.conv(hidden)


class Lfm2ForCausalLM(HybridForCausalLM):
    final_norm_name = "embedding_norm"
    norm_eps_attr = "norm_eps"
    stacked = (
        *LLAMA_STACKED[:3],  # q/k/v -> qkv_proj
        StackedParam("w13", "w1", 0),
        StackedParam("w13", "w3", 1),
    )

    def build_layer(self, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        layer_type = lfm2_layer_types(config)[layer_idx]
        ffn = self.build_feed_forward(config, layer_idx, join(prefix, "feed_forward"))
        return Lfm2DecoderLayer(config, self.rotary_emb, layer_type, ffn, prefix)

    def build_feed_forward(self, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        return Lfm2MLP(config.hidden_size, lfm2_intermediate_size(config), prefix)

    def load_weights(self, weights: Any) -> set[str]:
        # nn.Conv1d's weight is [hidden, 1, kernel]; accept a squeezed [hidden, kernel] too (some
        # converters drop the unit axis).
        def shaped(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
            if name.endswith(".conv.conv.weight") and t.dim() == 2:
                t = t.unsqueeze(1)
            return name, t

        return super().load_weights(shaped(n, t) for n, t in weights)


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE (e.g. LFM2-8B-A1B): LFM2 whose MLPs after the first ``num_dense_layers`` are
    sparse: a sigmoid router whose top-k choice adds a per-expert bias (``expert_bias``: it picks
    experts, it does not weigh them), weights renormalized (``norm_topk_prob``) and scaled by
    ``routed_scaling_factor``, experts of ``moe_intermediate_size``
    (``feed_forward.experts.N.w1/w3/w2``) on FusedMoE."""

    def build_feed_forward(self, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        if layer_idx < config.num_dense_layers:
            return Lfm2MLP(config.hidden_size, int(config.intermediate_size), prefix)
        return SparseMoeBlock(
            config.hidden_size, config.num_experts, prefix,
            top_k=config.num_experts_per_tok, intermediate_size=config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob), scoring_func="sigmoid",
            e_score_correction_bias=bool(config.use_expert_bias),
            routed_scaling_factor=float(config.routed_scaling_factor),
        )  # fmt: skip

    def rename_checkpoint_tensor(self, name: str) -> str | None:
        bias = ".feed_forward.expert_bias"
        return name.replace(bias, ".feed_forward.experts.e_score_correction_bias")
