"""Llama-family decoders: Llama, Mistral (sliding window), and the base of Qwen2/Qwen3.

Decode at batch 1 is dominated by Python and dispatch overhead on small models, so each layer runs
as few ops as possible: one fused q/k/v matmul, one fused gate/up matmul, rotary on q and k in one
op call, and the residual add fused into the next RMSNorm (the residual stream is carried between
layers and added by the following norm).

Interface the engine relies on: ``Model(hf_config, prefix="")`` built inside
:func:`llmhal.config.set_current_config`; ``forward(input_ids [T], positions [T]) -> [T, hidden]``
for a flattened varlen step (attention metadata from the forward context); optionally
``embed_input_ids(input_ids)`` and ``forward(None, positions, inputs_embeds)``, which let the
engine replay recorded decode steps; ``compute_logits(hidden) -> float32 [N, vocab]``;
``load_weights(iterable of (hf_name, tensor)) -> set of loaded names``. Optionally
``set_aux_hidden_state_layers(ids)``: each later forward keeps the inputs of those decoder layers in
``aux_hidden_states`` (EAGLE-3 and DFlash heads draft from them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from llmhal.attention.layer import Attention
from llmhal.config import get_current_config
from llmhal.distributed.pipeline import (
    IntermediateTensors,
    PPMissingLayer,
    pp_stage,
    stage_layers,
)
from llmhal.layers.activation import get_act_and_mul
from llmhal.layers.layernorm import RMSNorm
from llmhal.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from llmhal.layers.rotary_embedding import RotaryEmbedding, get_rope_from_hf_config
from llmhal.layers.vocab_embedding import ParallelLMHead, VocabEmbedding
from llmhal.models.utils import (
    LLAMA_STACKED,
    layer_sliding_window,
    load_weights_by_name,
    offer_packed_mapping,
    packed_mapping,
)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class LlamaMLP(nn.Module):
    def __init__(
        self,
        config: Any,
        *,
        bias: bool = False,
        intermediate_size: int | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        # Column- then row-parallel: one all-reduce per MLP under tensor parallelism.
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], bias=bias, prefix=_join(prefix, "gate_up_proj")
        )
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, bias=bias, prefix=_join(prefix, "down_proj")
        )
        self.act_fn = get_act_and_mul(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Self-attention with fused q/k/v, RoPE, optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(
        self,
        config: Any,
        rotary_emb: RotaryEmbedding,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool = False,
        sliding_window: int | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            total_heads,
            total_kv_heads,
            bias=qkv_bias,
            prefix=_join(prefix, "qkv_proj"),
        )
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Its inputs are the attention outputs of this rank's query heads.
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim,
            config.hidden_size,
            bias=o_bias,
            input_partition=self.qkv_proj.q_heads_partition,
            prefix=_join(prefix, "o_proj"),
        )
        # Shared by every layer of the model: not registered as a child here.
        self._rotary = (rotary_emb,)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            sliding_window=sliding_window,
            prefix=_join(prefix, "attn"),
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, self.q_size)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, self.kv_size)
        q, k = self._rotary[0](positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, rotary_emb: RotaryEmbedding, layer_opts: dict[str, Any], prefix: str
    ) -> None:
        super().__init__()
        opts = dict(layer_opts)
        # MoE models pass their own block (a callable of the module prefix) for this layer.
        build_mlp = opts.pop("build_mlp", None)
        self.self_attn = LlamaAttention(
            config, rotary_emb, prefix=_join(prefix, "self_attn"), **opts
        )
        if build_mlp is not None:
            self.mlp = build_mlp(_join(prefix, "mlp"))
        else:
            self.mlp = LlamaMLP(
                config, bias=bool(getattr(config, "mlp_bias", False)), prefix=_join(prefix, "mlp")
            )
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, layer_options: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        # Under pipeline parallelism this stage builds layers [start, end) only.
        stage, stages = pp_stage()
        self.is_first_stage, self.is_last_stage = stage == 0, stage == stages - 1
        self.start_layer, self.end_layer = stage_layers(config.num_hidden_layers, stage, stages)
        if self.is_first_stage:
            self.embed_tokens = VocabEmbedding(
                config.vocab_size, config.hidden_size, prefix=_join(prefix, "embed_tokens")
            )
        else:
            self.embed_tokens = PPMissingLayer()
        self.layer_options = layer_options
        self.rotary_emb = self.make_rotary(config)
        self.layers = nn.ModuleList(
            self.make_layer(config, i, _join(prefix, f"layers.{i}"))
            if self.start_layer <= i < self.end_layer
            else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        if self.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        else:
            self.norm = PPMissingLayer()
        # Decoder layers whose input (the residual stream so far) a forward keeps, for
        # speculative heads that draft from the target's inner layers (EAGLE-3).
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: list[Tensor] = []

    def make_rotary(self, config: Any) -> nn.Module:
        """The rotary embedding every layer shares (a model with another attention overrides
        this and :meth:`make_layer`, and keeps the stages and the forward)."""
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        # The table covers what the engine serves (max_model_len), not the model's whole context.
        max_len = get_current_config().model.max_model_len
        return get_rope_from_hf_config(config, head_dim, max_position=max_len or None)

    def make_layer(self, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        """Decoder layer ``layer_idx`` (built only on the stage that runs it)."""
        return LlamaDecoderLayer(
            config, self.rotary_emb, self.layer_options(config, layer_idx), prefix
        )

    def forward(
        self,
        ids: Tensor | None,
        positions: Tensor,
        embeds: Tensor | None = None,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> Tensor | IntermediateTensors:
        """``embeds`` (the step's input embeddings) replaces the lookup of ``ids`` when given.
        A stage after the first starts from the previous stage's ``intermediate_tensors``; a
        stage before the last returns its own (see llmhal.distributed.pipeline)."""
        if self.is_first_stage:
            hidden = self.embed_tokens(ids) if embeds is None else embeds
            residual = None
        else:
            if intermediate_tensors is None:
                raise ValueError(
                    "pipeline stage after the first needs the previous stage's intermediate_tensors"
                )
            # The residual stream so far; the stage's first norm starts from it as the first
            # layer does from the embeddings.
            hidden, residual = intermediate_tensors["hidden_states"], None
        taps: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers[self.start_layer : self.end_layer], self.start_layer):
            if i in self.aux_hidden_state_layers:
                taps[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual)
        if taps:
            self.aux_hidden_states = [taps[i] for i in self.aux_hidden_state_layers]
        if not self.is_last_stage:
            # Sent as one sum (what the next norm adds anyway): half the bytes of sending the
            # layer output and the residual apart.
            return IntermediateTensors({"hidden_states": hidden + residual})
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama (and Llama-architecture checkpoints such as SmolLM2); tied or untied LM head."""

    # Bias flags read from the HF config: q/k/v projections and the output projection.
    qkv_bias_attr: ClassVar[str | None] = "attention_bias"
    o_bias_attr: ClassVar[str | None] = "attention_bias"
    force_qkv_bias: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = False
    supports_sliding_window: ClassVar[bool] = False
    # Splits into pipeline stages (forward takes and returns IntermediateTensors).
    supports_pp: ClassVar[bool] = True
    # The decoder stack (a subclass with another layer kind gives its own LlamaModel subclass).
    model_cls: ClassVar[type[LlamaModel]] = LlamaModel

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = packed_mapping(LLAMA_STACKED)

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        offer_packed_mapping(self.packed_modules_mapping)
        self.model = self.model_cls(hf_config, self.layer_options, prefix=_join(prefix, "model"))
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if not self.model.is_last_stage:
            self.lm_head = PPMissingLayer()
        elif self.tie_word_embeddings and self.model.is_first_stage:
            self.lm_head = self.model.embed_tokens
        else:  # untied, or tied with the embedding on another stage: loaded from embed_tokens
            self.lm_head = ParallelLMHead(
                hf_config.vocab_size, hf_config.hidden_size, prefix=_join(prefix, "lm_head")
            )

    @classmethod
    def layer_options(cls, config: Any, layer_idx: int) -> dict[str, Any]:
        """Per-layer options (attention biases, q/k norm, sliding window; ``build_mlp``, a callable
        of the module prefix building the layer's MLP, where it is not Llama's) for this
        architecture."""

        def flag(attr: str | None) -> bool:
            return bool(attr and getattr(config, attr, False))

        window = layer_sliding_window(config, layer_idx) if cls.supports_sliding_window else None
        return {
            "qkv_bias": cls.force_qkv_bias or flag(cls.qkv_bias_attr),
            "o_bias": flag(cls.o_bias_attr),
            "qk_norm": cls.qk_norm,
            "sliding_window": window,
        }

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``input_ids`` (what ``forward`` starts from)."""
        return self.model.embed_tokens(input_ids)

    def set_aux_hidden_state_layers(self, layers: Iterable[int]) -> None:
        """Keep the input of each decoder layer in ``layers`` (in that order) in
        ``aux_hidden_states`` on every later forward; ``()`` stops it."""
        ids = tuple(int(i) for i in layers)
        n = self.config.num_hidden_layers
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(
                f"hidden-state layer ids {bad} are outside this model's {n} decoder layers "
                f"(0..{n - 1})"
            )
        self.model.aux_hidden_state_layers = ids
        self.model.aux_hidden_states = []

    @property
    def aux_hidden_states(self) -> list[Tensor]:
        """The last forward's kept layer inputs (see :meth:`set_aux_hidden_state_layers`)."""
        return self.model.aux_hidden_states

    def forward(
        self,
        input_ids: Tensor | None,
        positions: Tensor,
        inputs_embeds: Tensor | None = None,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> Tensor | IntermediateTensors:
        return self.model(input_ids, positions, inputs_embeds, intermediate_tensors)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)
        return logits if logits.dtype == torch.float32 else logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        ignored = ("lm_head.",) if self.lm_head is self.model.embed_tokens else ()
        return load_weights_by_name(
            self, self._stage_weights(weights), stacked=LLAMA_STACKED, ignored_prefixes=ignored
        )

    def _stage_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint tensors this pipeline stage holds (all of them without PP); a tied LM
        head on a stage without the embedding takes the embedding's tensors."""
        m = self.model
        if m.is_first_stage and m.is_last_stage:
            yield from weights
            return
        for name, t in weights:
            if name.startswith("model.layers."):
                if not m.start_layer <= int(name.split(".")[2]) < m.end_layer:
                    continue
            elif name.startswith("model.embed_tokens."):
                if not m.is_first_stage:
                    if not (self.tie_word_embeddings and m.is_last_stage):
                        continue
                    name = "lm_head." + name.removeprefix("model.embed_tokens.")
                    yield name, t
                    continue
            elif name.startswith("model.norm.") and not m.is_last_stage:
                continue
            elif name.startswith("lm_head.") and not m.is_last_stage:
                continue
            yield name, t


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with an optional sliding window on every layer (``sliding_window``)."""

    supports_sliding_window = True
