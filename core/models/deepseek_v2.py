"""DeepSeek-V2 and DeepSeek-V3: Multi-head Latent Attention and routed plus shared experts.

One code path, flags from the config (V3 = V2 with sigmoid routing and a bias):

* **MLA** (:mod:`llmhal.attention.mla`): the query comes from ``q_proj``, or with ``q_lora_rank``
  set from ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``; ``kv_a_proj_with_mqa`` gives the
  latent (normed by ``kv_a_layernorm``) and the shared rotary key; ``kv_b_proj`` expands the latent
  (the MLA layer absorbs it at decode). The latent is what the cache holds.
* **RoPE** on the last ``qk_rope_head_dim`` values only. DeepSeek rotates interleaved pairs
  (GPT-J style): V2 always, V3 when ``rope_interleave`` (its default). YaRN as DeepSeek uses it:
  the cos/sin scaled by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` and the softmax
  scale by ``mscale(factor, mscale_all_dim) ** 2``.
* **MoE** on layers from ``first_k_dense_replace`` on (before it, a dense MLP of
  ``intermediate_size``): ``n_routed_experts`` routed experts of ``moe_intermediate_size``, top
  ``num_experts_per_tok``, weights times ``routed_scaling_factor``, plus ``n_shared_experts`` shared
  experts as one dense MLP every token uses. Routing: V2 softmax, ``topk_method``
  ``group_limited_greedy`` limiting the choice to the ``topk_group`` best of ``n_group`` groups
  (a group scores its best expert); V3 sigmoid with ``e_score_correction_bias`` (choice only; a
  group scores its best two), always grouped. The router runs in float32 as DeepSeek's does.
  Renormalization follows ``norm_topk_prob`` (DeepSeek-V2's published configs set it False).

Checkpoint names are the published ones; the V3 router's ``mlp.gate.e_score_correction_bias`` is
the experts layer's bias here. V3's multi-token-prediction layers (``model.layers.<N>`` past
``num_hidden_layers``) are skipped: they serve speculative decoding, not the model
(:mod:`llmhal.spec_decode.mtp` loads them).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from llmhal.attention.mla.common import MLAAttention, MLADims
from llmhal.config import get_current_config
from llmhal.layers.fused_moe import FusedMoE, RouterLinear
from llmhal.layers.layernorm import RMSNorm
from llmhal.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
    tp_rank_and_size,
)
from llmhal.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_parameters
from llmhal.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from llmhal.models.moe import load_moe_weights
from llmhal.models.utils import (
    StackedParam,
    packed_mapping,
)

# Only the dense MLPs merge projections: DeepSeek's attention has no q/k/v projections to fuse.
DEEPSEEK_STACKED: tuple[StackedParam, ...] = (
    StackedParam("gate_up_proj", "gate_proj", 0),
    StackedParam("gate_up_proj", "up_proj", 1),
)
# DeepSeek's own RMSNorm default, used by q_a_layernorm and kv_a_layernorm (no eps in the config).
LATENT_NORM_EPS = 1e-6


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def is_v3(config: Any) -> bool:
    """DeepSeek-V3's routing (sigmoid, bias-corrected): its model type, or its original config's
    ``topk_method``."""
    return (
        getattr(config, "model_type", "") == "deepseek_v3"
        or getattr(config, "topk_method", None) == "noaux_tc"
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config: Any) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    m_all = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and m_all:
        scale *= yarn_mscale(params["factor"], m_all) ** 2
    return scale


def deepseek_rope(config: Any) -> RotaryEmbedding:
    params = rope_parameters(config)
    max_pe = int(config.max_position_embeddings)
    max_len = get_current_config().model.max_model_len or max_pe
    # V2 always rotates interleaved pairs; V3 unless its config says otherwise.
    interleaved = bool(getattr(config, "rope_interleave", True)) if is_v3(config) else True
    dim = config.qk_rope_head_dim
    return get_rope(
        dim, dim, max(max_len, 1), params, max_position_embeddings=max_pe,
        is_neox_style=not interleaved,
    )  # fmt: skip


class DeepseekMLA(nn.Module):
    """Multi-head latent attention. Under tensor parallelism the heads are split as vLLM splits
    them: each rank projects and attends with its ``num_heads / tp`` query heads (``q_proj`` /
    ``q_b_proj`` and ``kv_b_proj`` split along their head-major outputs, ``o_proj`` along its
    inputs, one all-reduce), while the latent projection and the latent cache, which have no heads,
    are whole on every rank."""

    def __init__(self, config: Any, rotary: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        h = config.hidden_size
        heads = config.num_attention_heads
        _, tp = tp_rank_and_size()
        self.dims = d = MLADims(
            divide(heads, tp, f"{_join(prefix, 'num_attention_heads')}: attention heads"),
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
            config.kv_lora_rank,
        )
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        q_out = heads * d.qk_head_dim
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, q_out, prefix=_join(prefix, "q_proj"))
        else:
            self.q_a_proj = ReplicatedLinear(
                h, self.q_lora_rank, bias=bias, prefix=_join(prefix, "q_a_proj")
            )
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, q_out, prefix=_join(prefix, "q_b_proj")
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            h, d.latent_size, bias=bias, prefix=_join(prefix, "kv_a_proj_with_mqa")
        )
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            d.kv_lora_rank,
            heads * (d.qk_nope_head_dim + d.v_head_dim),
            prefix=_join(prefix, "kv_b_proj"),
        )
        self.o_proj = RowParallelLinear(
            heads * d.v_head_dim, h, bias=bias, prefix=_join(prefix, "o_proj")
        )
        self._rotary = (rotary,)  # shared by every layer: not a child here
        self.attn = MLAAttention(
            d, softmax_scale(config), self.kv_b_proj, prefix=_join(prefix, "attn")
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        d, t = self.dims, hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(t, d.num_heads, d.qk_head_dim)
        q_nope, q_pe = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split(
            [d.kv_lora_rank, d.qk_rope_head_dim], dim=-1
        )
        # Views, no copies: the norm reads strided rows, and a rotary kernel that takes a
        # [t, heads, rope] view rotates q_pe inside q (the CPU's does), so a decode step makes no
        # torch call here and can be recorded as a step graph.
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe_rotated, k_pe = self._rotary[0](positions, q_pe, k_pe)
        if q_pe_rotated is not q_pe:  # rotated out of place (torch's kernels): put it into q
            q = torch.cat([q_nope, q_pe_rotated.view(t, d.num_heads, -1)], dim=-1)
        return self.o_proj(self.attn(q, kv_c, k_pe))


class DeepseekMoE(nn.Module):
    """Routed experts (``gate`` + ``experts``) plus the shared experts, summed."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        n = config.n_routed_experts
        v3 = is_v3(config)
        grouped = v3 or getattr(config, "topk_method", "greedy") == "group_limited_greedy"
        # The router stays float32 (DeepSeek keeps gate.weight in fp32 in every dtype).
        self.gate = RouterLinear(
            config.hidden_size, n, params_dtype=torch.float32, prefix=_join(prefix, "gate")
        )
        self.experts = FusedMoE(
            n,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            scoring_func="sigmoid" if v3 else "softmax",
            num_expert_group=config.n_group if grouped else None,
            topk_group=config.topk_group if grouped else None,
            e_score_correction_bias=v3,
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0)),
            activation=config.hidden_act,
            prefix=_join(prefix, "experts"),
        )
        shared = getattr(config, "n_shared_experts", 0) or 0
        self.shared_experts = (
            LlamaMLP(
                config,
                bias=bool(getattr(config, "mlp_bias", False)),
                intermediate_size=config.moe_intermediate_size * shared,
                prefix=_join(prefix, "shared_experts"),
            )
            if shared
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The float32 router widens x itself; the shared experts' sum goes into the MoE op, which
        # adds it in the same native call as the routed experts where the platform's op can.
        shared = None if self.shared_experts is None else self.shared_experts(x)
        return self.experts(x, self.gate(x), shared_output=shared)


# The decoder layer runs as Llama's does (the residual stream carried into the next norm): it
# inherits that forward and builds its own attention and MLP.


class DeepseekDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, rotary: RotaryEmbedding, layer_idx: int, prefix: str) -> None:
        nn.Module.__init__(self)
        self.self_attn = DeepseekMLA(config, rotary, _join(prefix, "self_attn"))
        mlp_prefix = _join(prefix, "mlp")
        if layer_idx >= (getattr(config, "first_k_dense_replace", 0) or 0):
            self.mlp: nn.Module = DeepseekMoE(config, mlp_prefix)
        else:
            bias = bool(getattr(config, "mlp_bias", False))
            self.mlp = LlamaMLP(config, bias=bias, prefix=mlp_prefix)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepseekModel(LlamaModel):
    """Llama's decoder stack (pipeline stages included) with DeepSeek's layers: MLA, and routed
    plus shared experts after the first ``first_k_dense_replace`` dense layers."""

    def make_rotary(self, config: Any) -> nn.Module:
        return deepseek_rope(config)

    def make_layer(self, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        return DeepseekDecoderLayer(config, self.rotary_emb, layer_idx, prefix)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 (and, as :class:`DeepseekV3ForCausalLM`, V3): Llama's model interface and
    pipeline stages (see :mod:`llmhal.models.llama`) over :class:`DeepseekModel`."""

    model_cls = DeepseekModel
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = packed_mapping(DEEPSEEK_STACKED)

    def _rename(self, name: str) -> str | None:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= self.config.num_hidden_layers:
            return None  # a multi-token-prediction layer
        return name.replace(
            ".mlp.gate.e_score_correction_bias", ".mlp.experts.e_score_correction_bias"
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = ((new, t) for n, t in weights if (new := self._rename(n)) is not None)
        return load_moe_weights(self, renamed, DEEPSEEK_STACKED)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: the V2 code with sigmoid, bias-corrected, grouped routing (from its config)."""
