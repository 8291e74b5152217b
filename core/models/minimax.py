"""MiniMax-Text-01 (``MiniMaxForCausalLM``): lightning attention (linear attention with a
per-head decay, a recurrent layer of kind ``linear`` on the state cache, backend ``linear_attn``)
on most layers and softmax attention (paged KV cache) on the others (``layer_types``), a sparse
MoE MLP (softmax top-k, renormalized) on every layer.

Why this linear-attention model: it is the one vLLM's ``linear_attn`` backend serves, transformers
implements it (``MiniMaxLightningAttention``, the numerical reference here), and its recurrence is
a plain decayed outer-product sum, so one float32 state per request and layer serves any context.

Its residual stream is unusual: each half-layer's residual is the *normed* input, scaled by
``*_alpha_factor``, plus the sublayer's output scaled by ``*_beta_factor`` (all 1 by default).
Published names: ``self_attn.{qkv_proj,output_gate,norm,out_proj}`` (lightning layers),
``self_attn.{q,k,v,o}_proj`` (softmax layers), ``block_sparse_moe.gate`` and
``block_sparse_moe.experts.N.w1/w2/w3`` (transformers 5 may save ``mlp.experts.gate_up_proj``);
``slope_rate`` and the decay tables are derived from the layer index and are recomputed.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from llmhal.layers.layernorm import RMSNorm
from llmhal.layers.lightning_attn import LightningAttention
from llmhal.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_parameters
from llmhal.models.hybrid import HybridForCausalLM, SoftmaxAttention, head_dim_of, join
from llmhal.models.moe import topk_moe_block

# Buffers transformers saves with the lightning layers; all follow from the layer's depth.
_DERIVED = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def minimax_layer_types(config: Any) -> list[str]:
    # MiniMax-Text-01's own config: attn_type_list, 1 = softmax, 0 = lightning. It wins over
    # layer_types, which transformers fills with its default pattern when the file has none.
    flags = getattr(config, "attn_type_list", None)
    if flags:
        return ["full_attention" if f else "linear_attention" for f in flags]
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    raise ValueError("the MiniMax config has neither layer_types nor attn_type_list")


class MiniMaxDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, rotary: RotaryEmbedding, layer_idx: int, layer_type: str, prefix: str
    ) -> None:
        super().__init__()
        self.linear = layer_type == "linear_attention"
        attn_prefix = join(prefix, "self_attn")
        if self.linear:
            self.self_attn: nn.Module = LightningAttention(
                config.hidden_size, config.num_attention_heads, head_dim_of(config),
                layer_idx=layer_idx, num_layers=config.num_hidden_layers,
                hidden_act=config.hidden_act, block_size=int(getattr(config, "block_size", 256)),
                prefix=attn_prefix,
            )  # fmt: skip
            factors = ("linear_attn_alpha_factor", "linear_attn_beta_factor")
        elif layer_type == "full_attention":
            window = getattr(config, "sliding_window", None)
            self.self_attn = SoftmaxAttention(
                config, rotary, sliding_window=window, prefix=attn_prefix
            )
            factors = ("full_attn_alpha_factor", "full_attn_beta_factor")
        else:
            raise ValueError(
                f"MiniMax layer type {layer_type!r} is not supported; known: linear_attention, "
                "full_attention"
            )
        self.attn_alpha, self.attn_beta = (float(getattr(config, f, 1.0)) for f in factors)
        self.mlp_alpha = float(getattr(config, "mlp_alpha_factor", 1.0))
        self.mlp_beta = float(getattr(config, "mlp_beta_factor", 1.0))
        self.mlp = topk_moe_block(config, join(prefix, "mlp"), renormalize=True)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)

    def forward(
        self, positions: Tensor, hidden: Tensor, residual: Tensor | None
    ) -> tuple[Tensor, None]:
        hidden = self.input_layernorm(hidden)
        mixed = self.self_attn(hidden) if self.linear else self.self_attn(positions, hidden)
        hidden = _scaled_sum(hidden, self.attn_alpha, mixed, self.attn_beta)
        hidden = self.post_attention_layernorm(hidden)
        return _scaled_sum(hidden, self.mlp_alpha, self.mlp(hidden), self.mlp_beta), None


def _scaled_sum(a: Tensor, alpha: float, b: Tensor, beta: float) -> Tensor:
    if alpha == 1.0 and beta == 1.0:
        return a + b
    return a * alpha + b * beta


class MiniMaxForCausalLM(HybridForCausalLM):
    def build_rotary(self, config: Any, max_position: int | None) -> RotaryEmbedding:
        # The published config rotates only ``rotary_dim`` of each head's dims (64 of 128), as
        # MiniMax's own code and vLLM do; configs without it rotate the whole head (transformers).
        head_dim = head_dim_of(config)
        rotary_dim = getattr(config, "rotary_dim", None)
        if not rotary_dim or rotary_dim == head_dim:
            return super().build_rotary(config, max_position)
        max_pe = int(config.max_position_embeddings)
        return get_rope(
            head_dim, int(rotary_dim), max_position or max_pe, rope_parameters(config),
            max_position_embeddings=max_pe,
        )  # fmt: skip

    def build_layer(self, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        layer_type = minimax_layer_types(config)[layer_idx]
        return MiniMaxDecoderLayer(config, self.rotary_emb, layer_idx, layer_type, prefix)

    def rename_checkpoint_tensor(self, name: str) -> str | None:
        if name.rpartition(".")[2] in _DERIVED:
            return None
        return name.replace(".block_sparse_moe.", ".mlp.")
