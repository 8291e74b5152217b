"""What the decoders with recurrent layers share (LFM2, MiniMax-Text-01, Bamba): a stack of
layers, each with a sequence mixer of its own kind (softmax attention on the paged KV cache, or a
:class:`~llmhal.attention.state.RecurrentLayer` on the state cache), an MLP, and an embedding and
LM head as in the Llama family.

A model class says how to build layer ``i`` (:meth:`HybridForCausalLM.build_layer`) and what the
final norm is called in its checkpoints. Layers follow the Llama layers' convention: ``layer(
positions, hidden, residual) -> (hidden, residual)``, the residual carried to the next norm (a
layer that adds its residual itself returns ``None``). To the engine these are ordinary decoder
models; the recurrent layers find their states and metadata themselves.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from llmhal.attention.layer import Attention
from llmhal.config import get_current_config
from llmhal.layers.fused_moe import FusedMoE
from llmhal.layers.layernorm import RMSNorm
from llmhal.layers.linear import QKVLinear, ReplicatedLinear
from llmhal.layers.rotary_embedding import RotaryEmbedding, get_rope_from_hf_config
from llmhal.layers.vocab_embedding import VocabEmbedding
from llmhal.models.moe import _ExpertLoader as ExpertLoader
from llmhal.models.utils import (
    LLAMA_STACKED,
    StackedParam,
    load_weights_by_name,
    offer_packed_mapping,
    output_head,
    packed_mapping,
)


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class SoftmaxAttention(nn.Module):
    """Self-attention with fused q/k/v and RoPE on the paged KV cache; optional per-head q/k
    RMSNorms. ``names`` maps our parameter names to the checkpoint's where they differ (the output
    projection and the q/k norms are named differently by each family)."""

    def __init__(
        self,
        config: Any,
        rotary: RotaryEmbedding,
        *,
        out_name: str = "o_proj",
        qk_norm: tuple[str, str, float] | None = None,
        bias: bool = False,
        sliding_window: int | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, self.heads, self.kv_heads, bias=bias,
            prefix=join(prefix, "qkv_proj"),
        )  # fmt: skip
        self.out_name = out_name
        out = ReplicatedLinear(
            self.heads * self.head_dim, config.hidden_size, bias=bias, prefix=join(prefix, out_name)
        )
        self.add_module(out_name, out)
        self.qk_norm_names = qk_norm[:2] if qk_norm else None
        if qk_norm:
            for name in qk_norm[:2]:
                self.add_module(name, RMSNorm(self.head_dim, eps=qk_norm[2]))
        self._rotary = (rotary,)  # shared by every layer: not a child here
        self.attn = Attention(
            self.heads, self.head_dim, self.head_dim**-0.5, self.kv_heads,
            sliding_window=sliding_window, prefix=join(prefix, "attn"),
        )  # fmt: skip

    def forward(self, positions: Tensor, hidden: Tensor) -> Tensor:
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        if self.qk_norm_names is not None:
            t = hidden.shape[0]
            q_norm, k_norm = (getattr(self, n) for n in self.qk_norm_names)
            q = q_norm(q.reshape(t, self.heads, self.head_dim)).view(t, q_size)
            k = k_norm(k.reshape(t, self.kv_heads, self.head_dim)).view(t, kv_size)
        q, k = self._rotary[0](positions, q, k)
        return getattr(self, self.out_name)(self.attn(q, k, v))


class PreNormDecoderLayer(nn.Module):
    """``x + mixer(norm(x))``, then ``x + mlp(norm(x))``, with the residual add fused into the next
    norm as in the Llama layers. Subclasses register their modules under the checkpoint's names,
    list (first norm, second norm, MLP) in ``names`` and implement :meth:`mix`."""

    names: ClassVar[tuple[str, str, str]]

    def mix(self, positions: Tensor, hidden: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(
        self, positions: Tensor, hidden: Tensor, residual: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        first, second, mlp = (getattr(self, n) for n in self.names)
        if residual is None:
            residual, hidden = hidden, first(hidden)
        else:
            hidden, residual = first(hidden, residual)
        hidden, residual = second(self.mix(positions, hidden), residual)
        return mlp(hidden), residual


class HybridForCausalLM(nn.Module):
    """Base of the models with recurrent layers; subclasses implement :meth:`build_layer`."""

    final_norm_name: ClassVar[str] = "norm"
    norm_eps_attr: ClassVar[str] = "rms_norm_eps"
    stacked: ClassVar[tuple[StackedParam, ...]] = LLAMA_STACKED

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        offer_packed_mapping(packed_mapping(self.stacked))
        model_prefix = join(prefix, "model")
        self.model = nn.Module()
        self.model.embed_tokens = VocabEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, prefix=join(model_prefix, "embed_tokens")
        )
        # The table covers what the engine serves (max_model_len), not the model's whole context.
        max_len = get_current_config().model.max_model_len
        self.rotary_emb = self.build_rotary(hf_config, max_len or None)
        self.model.layers = nn.ModuleList(
            self.build_layer(hf_config, i, join(model_prefix, f"layers.{i}"))
            for i in range(hf_config.num_hidden_layers)
        )
        norm = RMSNorm(hf_config.hidden_size, eps=getattr(hf_config, self.norm_eps_attr))
        self.model.add_module(self.final_norm_name, norm)
        self.tie_word_embeddings, self.lm_head = output_head(
            hf_config, self.model.embed_tokens, join(prefix, "lm_head")
        )

    def build_rotary(self, config: Any, max_position: int | None) -> RotaryEmbedding:
        return get_rope_from_hf_config(config, head_dim_of(config), max_position=max_position)

    def build_layer(self, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        raise NotImplementedError

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self, input_ids: Tensor | None, positions: Tensor, inputs_embeds: Tensor | None = None
    ) -> Tensor:
        hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual)
        norm = getattr(self.model, self.final_norm_name)
        return norm(hidden) if residual is None else norm(hidden, residual)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head.logits(hidden)
        return logits if logits.dtype == torch.float32 else logits.float()

    def rename_checkpoint_tensor(self, name: str) -> str | None:
        """The model's name for a checkpoint tensor; None skips it (derived buffers)."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        ignored = ("lm_head.",) if self.tie_word_embeddings else ()
        stream = (
            (new, t) for n, t in weights if (new := self.rename_checkpoint_tensor(n)) is not None
        )
        if not any(isinstance(m, FusedMoE) for m in self.modules()):
            return load_weights_by_name(
                self, stream, stacked=self.stacked, ignored_prefixes=ignored
            )
        # Expert tensors (per expert, or stacked) go to the FusedMoE layers as in the MoE models.
        experts = ExpertLoader(self)
        loaded = load_weights_by_name(
            self, experts.split(stream), stacked=self.stacked, ignored_prefixes=ignored
        )
        return loaded | experts.finish()
