"""Mamba-2 (``Mamba2ForCausalLM``): a stack of pre-norm residual Mamba-2 mixers, no attention.

Each request keeps one conv state and one SSM state per layer in the engine's state cache (see
:mod:`llmhal.attention.state`); the model needs no KV cache. Tensor names are HF's
(``backbone.embeddings``, ``backbone.layers.N.{norm,mixer.*}``, ``backbone.norm_f``, ``lm_head``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from llmhal.layers.layernorm import RMSNorm
from llmhal.layers.mamba2_mixer import Mamba2Mixer
from llmhal.layers.vocab_embedding import VocabEmbedding
from llmhal.models.utils import load_weights_by_name, output_head


class MambaBlock(nn.Module):
    """Pre-norm residual block around a mixer (``build_mixer(config, prefix)``)."""

    def __init__(self, config: Any, build_mixer: Any, prefix: str) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = build_mixer(config, f"{prefix}.mixer")

    def forward(self, hidden: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        # The residual add is fused into the next norm, as in the Llama family.
        if residual is None:
            residual, hidden = hidden, self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        return self.mixer(hidden), residual


class MambaModel(nn.Module):
    def __init__(self, config: Any, build_mixer: Any, prefix: str = "backbone") -> None:
        super().__init__()
        self.embeddings = VocabEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embeddings"
        )
        self.layers = nn.ModuleList(
            MambaBlock(config, build_mixer, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, ids: Tensor | None, inputs_embeds: Tensor | None = None) -> Tensor:
        hidden = self.embeddings(ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        hidden, _ = self.norm_f(hidden, residual)
        return hidden


class Mamba2ForCausalLM(nn.Module):
    """Also the base of Mamba-1 (:mod:`llmhal.models.mamba`), which overrides :meth:`build_mixer`."""

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        self.backbone = MambaModel(hf_config, self.build_mixer)
        self.tie_word_embeddings, self.lm_head = output_head(
            hf_config, self.backbone.embeddings, "lm_head"
        )

    def build_mixer(self, config: Any, prefix: str) -> nn.Module:
        return Mamba2Mixer(
            config.hidden_size,
            num_heads=config.num_heads,
            head_dim=config.head_dim,
            state_size=config.state_size,
            n_groups=config.n_groups,
            conv_kernel=config.conv_kernel,
            intermediate_size=int(config.expand * config.hidden_size),
            chunk_size=config.chunk_size,
            use_bias=config.use_bias,
            use_conv_bias=config.use_conv_bias,
            activation=config.hidden_act,
            norm_eps=config.layer_norm_epsilon,
            dt_limit=tuple(config.time_step_limit),
            prefix=prefix,
        )

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.backbone.embeddings(input_ids)

    def forward(
        self, input_ids: Tensor | None, positions: Tensor, inputs_embeds: Tensor | None = None
    ) -> Tensor:
        # Positions play no part: the order of tokens is carried by the states. Embeddings may
        # come in (decode-step graphs look the tokens up outside the recorded step).
        return self.backbone(input_ids, inputs_embeds)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head.logits(hidden)
        return logits if logits.dtype == torch.float32 else logits.float()

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        ignored = ("lm_head.",) if self.tie_word_embeddings else ()
        # Original state-spaces checkpoints name the table "embedding" (HF renames it on load).
        renamed = ((n.replace(".embedding.", ".embeddings."), t) for n, t in weights)
        return load_weights_by_name(self, renamed, stacked=(), ignored_prefixes=ignored)
