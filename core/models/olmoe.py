"""OLMoE: the Llama decoder with a sparse MoE block on every layer and q/k RMSNorm across all heads.

Differences from the models it builds on:

* the q and k norms (``q_norm``, ``k_norm``) normalise the whole projection (every head together,
  weights of ``num_heads * head_dim`` and ``num_kv_heads * head_dim``), not each head as Qwen3's do;
* with ``clip_qkv`` set, q, k and v are clamped to ``[-clip_qkv, clip_qkv]`` after the norms;
* every layer routes each token to ``num_experts_per_tok`` of ``num_experts`` experts of width
  ``intermediate_size`` by softmax, renormalized when ``norm_topk_prob``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmhal.layers.layernorm import RMSNorm
from llmhal.layers.rotary_embedding import RotaryEmbedding
from llmhal.models.llama import LlamaAttention
from llmhal.models.moe import MoeForCausalLM, topk_moe_block


class OlmoeAttention(LlamaAttention):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, prefix: str, **opts: Any) -> None:
        super().__init__(config, rotary_emb, prefix=prefix, **{**opts, "qk_norm": False})
        if self.num_heads != config.num_attention_heads:
            # Tensor parallelism gave this rank a share of the heads; the norms need all of them.
            raise NotImplementedError(
                "OLMoE's q/k norms span every attention head, which tensor parallelism splits "
                "across ranks; run OlmoeForCausalLM with tensor_parallel_size=1"
            )
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.q_size, eps=eps)
        self.k_norm = RMSNorm(self.kv_size, eps=eps)
        self.clip_qkv = getattr(config, "clip_qkv", None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q, k = self._rotary[0](positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous()))


class OlmoeForCausalLM(MoeForCausalLM):
    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        super().__init__(hf_config, prefix)
        # The decoder layers are Llama's; only their attention differs (the norms' width), so it
        # is rebuilt here under the same module name, which keeps the checkpoint names.
        for i, layer in enumerate(self.model.layers):
            old = getattr(layer, "self_attn", None)
            if old is None:
                continue  # a layer another pipeline stage holds
            opts = {k: v for k, v in self.layer_options(hf_config, i).items() if k != "build_mlp"}
            name = f"{prefix}.model.layers.{i}.self_attn".lstrip(".")
            layer.self_attn = OlmoeAttention(hf_config, old._rotary[0], name, **opts)

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        renormalize = bool(getattr(config, "norm_topk_prob", False))
        return topk_moe_block(config, prefix, renormalize=renormalize)
