"""One decoder layer of a drafting head (EAGLE, EAGLE-3, DFlash) over plain tensors.

A head has one or a few Llama-style layers, and the proposer keeps each request's keys and values
for them as dense tensors (outside the target's paged cache): :class:`HeadLayer` runs such a layer
over the rows of several requests at once, each attending to its own kept keys and values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

# The activations a head's config may name (``hidden_act``).
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm's numerics (computed in float32)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class HeadLayer:
    """One Llama decoder layer of a head over plain tensors, attending over the keys and values the
    caller keeps. ``forward(attn_in, residual, positions, past_k, past_v)`` takes the attention's
    input (what a Llama layer gets from its input norm; EAGLE-3 feeds 2H features) and the residual
    stream, and returns the layer's output with this call's keys and values ([t, kv_heads, dim])."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, cfg: Any, rope: Any) -> None:
        def get(name: str) -> torch.Tensor | None:
            return w.get(f"{prefix}{name}")

        self.q, self.q_b = get("self_attn.q_proj.weight"), get("self_attn.q_proj.bias")
        self.k, self.k_b = get("self_attn.k_proj.weight"), get("self_attn.k_proj.bias")
        self.v, self.v_b = get("self_attn.v_proj.weight"), get("self_attn.v_proj.bias")
        self.o, self.o_b = get("self_attn.o_proj.weight"), get("self_attn.o_proj.bias")
        self.gate, self.up = get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")
        self.down = get("mlp.down_proj.weight")
        self.post_norm = get("post_attention_layernorm.weight")
        self.input_norm = get("input_layernorm.weight")
        # Per-head q/k norms (Qwen3-style heads: DFlash); None where the head has none.
        self.q_norm, self.k_norm = get("self_attn.q_norm.weight"), get("self_attn.k_norm.weight")
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.act = ACTIVATIONS[getattr(cfg, "hidden_act", "silu")]
        self.rope = rope

    def forward(
        self,
        attn_in: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        lens: Sequence[int],
        causal: bool = True,
        masks: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Rows of several requests at once: ``lens[i]`` rows of request i, which attend to its
        kept keys and values ``kv[i]`` and to its own new rows (up to themselves where
        ``causal``; all of them in a bidirectional block, as DFlash's; or what ``masks[i]``, bool
        [lens[i], kept + lens[i]], allows: a draft tree's nodes). The projections run over all
        rows together; returns the output and each request's new keys and values."""
        t = attn_in.shape[0]
        q = self._heads_normed(F.linear(attn_in, self.q, self.q_b), self.q_norm, self.heads)
        k = self._heads_normed(F.linear(attn_in, self.k, self.k_b), self.k_norm, self.kv_heads)
        v = F.linear(attn_in, self.v, self.v_b).view(t, self.kv_heads, self.dim)
        q, k = self.rope(positions, q, k)
        q, k = q.view(t, self.heads, self.dim), k.reshape(t, self.kv_heads, self.dim)
        rep = self.heads // self.kv_heads
        outs, new_k, new_v = [], [], []
        row = 0
        for r, ((past_k, past_v), n) in enumerate(zip(kv, lens, strict=True)):
            kn, vn = k[row : row + n], v[row : row + n]
            keys, values = torch.cat([past_k, kn]), torch.cat([past_v, vn])
            p = past_k.shape[0]
            # Row i (position p + i) sees the kept positions and the new ones up to itself.
            mask = None if masks is None else masks[r]
            if mask is None and causal and n > 1:
                mask = torch.arange(p + n, device=q.device)[None, :] <= p + torch.arange(n, device=q.device)[:, None]  # fmt: skip
            outs.append(
                F.scaled_dot_product_attention(
                    q[row : row + n].transpose(0, 1),
                    keys.repeat_interleave(rep, 1).transpose(0, 1),
                    values.repeat_interleave(rep, 1).transpose(0, 1),
                    attn_mask=mask,
                ).transpose(0, 1)
            )
            new_k.append(kn)
            new_v.append(vn)
            row += n
        att = outs[0] if len(outs) == 1 else torch.cat(outs)
        h = residual + F.linear(att.reshape(t, -1), self.o, self.o_b)
        m = rms_norm(h, self.post_norm, self.eps)
        mlp = F.linear(self.act(F.linear(m, self.gate)) * F.linear(m, self.up), self.down)
        return h + mlp, new_k, new_v

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of ``x`` at ``positions`` alone ([t, kv_heads, dim]):
        context a head attends to without running the layer over it (DFlash's target features)."""
        t = x.shape[0]
        k = self._heads_normed(F.linear(x, self.k, self.k_b), self.k_norm, self.kv_heads)
        _, k = self.rope(positions, k.clone(), k)  # the op rotates a query too: a throwaway one
        v = F.linear(x, self.v, self.v_b).view(t, self.kv_heads, self.dim)
        return k.reshape(t, self.kv_heads, self.dim), v

    def _heads_normed(self, x: torch.Tensor, weight: torch.Tensor | None, heads: int) -> torch.Tensor:  # fmt: skip
        if weight is None:
            return x
        t = x.shape[0]
        return rms_norm(x.view(t, heads, self.dim), weight, self.eps).reshape(t, -1)
