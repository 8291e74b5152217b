"""MiniMax-Text-01's lightning attention: linear attention with a per-head decay, a recurrent
layer of kind ``linear`` (see :mod:`llmhal.attention.state` and :mod:`llmhal.ops.linear_attn_ops`).

``q, k, v = act(qkv_proj(x))`` (interleaved per head: head ``h`` owns columns ``3hD .. 3hD+3D`` as
q, k, v), then the decayed linear attention, an RMSNorm over all heads, a sigmoid output gate on
the layer's input, and ``out_proj``. Each request's past is one ``[heads, D, D]`` state (stored in ``mamba_cache_dtype``, updated in float32).
Parameters keep the published names (``qkv_proj``, ``output_gate``, ``norm``, ``out_proj``); the
decay rates depend only on the layer's depth and are computed, not loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmhal.attention.state import RecurrentLayer, StateSpec
from llmhal.layers.layernorm import RMSNorm
from llmhal.layers.linear import ReplicatedLinear
from llmhal.ops.linear_attn_ops import DEFAULT_BLOCK, decay_rates
from llmhal.ops.registry import get_op

_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu}


class LightningAttention(RecurrentLayer):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        layer_idx: int,
        num_layers: int,
        hidden_act: str = "silu",
        block_size: int = DEFAULT_BLOCK,
        norm_eps: float = 1e-6,
        prefix: str = "",
    ) -> None:
        super().__init__("linear", prefix=prefix, head_size=head_dim, num_heads=num_heads)
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"lightning attention: hidden_act={hidden_act!r} is not supported; "
                f"supported: {', '.join(_ACTIVATIONS)}"
            )
        self.num_heads, self.head_dim = num_heads, head_dim
        self.block_size = block_size
        self.act = _ACTIVATIONS[hidden_act]
        inner = num_heads * head_dim
        self.qkv_proj = ReplicatedLinear(hidden_size, 3 * inner, prefix=f"{prefix}.qkv_proj")
        self.output_gate = ReplicatedLinear(hidden_size, inner, prefix=f"{prefix}.output_gate")
        self.out_proj = ReplicatedLinear(inner, hidden_size, prefix=f"{prefix}.out_proj")
        self.norm = RMSNorm(inner, eps=norm_eps)
        self.register_buffer(
            "decay", decay_rates(num_heads, layer_idx, num_layers), persistent=False
        )
        self._prefill = get_op("lightning_attn_prefill")
        self._decode = get_op("lightning_attn_decode")

    def state_specs(self) -> tuple[StateSpec, ...]:
        # mamba_cache_dtype, as vLLM keeps linear attention's state (auto: the model's dtype).
        return (
            StateSpec("kv", (self.num_heads, self.head_dim, self.head_dim), self.conv_state_dtype),
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = self.act(self.qkv_proj(hidden)).view(t, self.num_heads, 3 * self.head_dim)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        meta = self.metadata()
        (kv_state,) = self.states
        out = torch.zeros_like(q)  # rows past num_actual_tokens (padding) stay zero
        d, n = meta.num_decode_tokens, meta.num_actual_tokens
        if d:
            out[:d] = self._decode(
                q[:d], k[:d], v[:d], self.decay, kv_state, meta.decode_state_indices
            )
        if meta.num_prefills:
            out[d:n] = self._prefill(
                q[d:n],
                k[d:n],
                v[d:n],
                self.decay,
                kv_state,
                meta.prefill_query_start_loc,
                meta.prefill_state_indices,
                meta.prefill_has_initial_state,
                self.block_size,
            )
        attn = self.norm(out.reshape(t, -1))
        return self.out_proj(torch.sigmoid(self.output_gate(hidden)) * attn)
