"""Bamba (IBM, ``BambaForCausalLM``): a hybrid of Mamba-2 layers and softmax attention layers
(``attn_layer_indices``), a SwiGLU MLP on every layer.

The Mamba-2 layers are :class:`~llmhal.layers.mamba2_mixer.Mamba2Mixer` recurrent layers (kind
``mamba2``: a conv and an SSM state per request on the state cache, backend ``mamba2_attn``); the
attention layers use the paged KV cache and the platform's attention backend, with RoPE on half of
each head (transformers fixes Bamba's ``partial_rotary_factor`` at 0.5). So a request holds a few
KV blocks for its attention layers and one state slot, and the engine admits as many requests as
both caches allow. Published names: ``mamba.{in_proj,conv1d,dt_bias,A_log,D,norm,out_proj}``,
``self_attn.{q,k,v,o}_proj``, ``feed_forward.{gate,up,down}_proj``, ``input_layernorm``,
``pre_ff_layernorm``, ``model.final_layernorm``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from llmhal.layers.layernorm import RMSNorm
from llmhal.layers.mamba2_mixer import Mamba2Mixer
from llmhal.layers.rotary_embedding import RotaryEmbedding
from llmhal.models.hybrid import (
    HybridForCausalLM,
    PreNormDecoderLayer,
    SoftmaxAttention,
    join,
)
from llmhal.models.llama import LlamaMLP


def bamba_mixer(config: Any, prefix: str) -> Mamba2Mixer:
    inner = int(config.mamba_expand * config.hidden_size)
    head_dim = config.mamba_d_head
    if head_dim == "auto":  # a raw config.json; transformers resolves it when it loads one
        head_dim = inner // config.mamba_n_heads
    limit = getattr(config, "time_step_limit", None) or (0.0, float("inf"))
    return Mamba2Mixer(
        config.hidden_size,
        num_heads=config.mamba_n_heads,
        head_dim=int(head_dim),
        state_size=config.mamba_d_state,
        n_groups=config.mamba_n_groups,
        conv_kernel=config.mamba_d_conv,
        intermediate_size=inner,
        chunk_size=config.mamba_chunk_size,
        use_bias=bool(config.mamba_proj_bias),
        use_conv_bias=bool(config.mamba_conv_bias),
        activation=config.hidden_act,
        norm_eps=config.rms_norm_eps,
        dt_limit=tuple(limit),
        prefix=prefix,
    )


class BambaDecoderLayer(PreNormDecoderLayer):
    names = ("input_layernorm", "pre_ff_layernorm", "feed_forward")

    def __init__(self, config: Any, rotary: RotaryEmbedding, attention: bool, prefix: str) -> None:
        super().__init__()
        self.is_attention = attention
        if attention:
            self.self_attn = SoftmaxAttention(
                config, rotary, bias=bool(getattr(config, "attention_bias", False)),
                prefix=join(prefix, "self_attn"),
            )  # fmt: skip
        else:
            self.mamba = bamba_mixer(config, join(prefix, "mamba"))
        self.feed_forward = LlamaMLP(
            config,
            bias=bool(getattr(config, "mlp_bias", False)),
            prefix=join(prefix, "feed_forward"),
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def mix(self, positions: Tensor, hidden: Tensor) -> Tensor:
        return self.self_attn(positions, hidden) if self.is_attention else self.mamba(hidden)


class BambaForCausalLM(HybridForCausalLM):
    final_norm_name = "final_layernorm"

    def build_layer(self, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        attention = layer_idx in (getattr(config, "attn_layer_indices", None) or ())
        return BambaDecoderLayer(config, self.rotary_emb, attention, prefix)
