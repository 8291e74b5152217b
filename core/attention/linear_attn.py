"""``linear_attn``: the backend of linear attention with a per-head decay (MiniMax-Text-01's
lightning attention).

A linear-attention layer keeps one ``[heads, head_dim, head_dim]`` key-value state per request in
float32 (it sums the whole past; a half-precision sum would drift over long contexts). Prefills
run the blockwise ``lightning_attn_prefill`` over the prefill requests, decodes the one-step
``lightning_attn_decode``; the computation lives in
:class:`llmhal.layers.lightning_attn.LightningAttention`.
"""

from __future__ import annotations

from llmhal.attention.state import RecurrentBackend


class LinearAttentionBackend(RecurrentBackend):
    name = "linear_attn"
    kind = "linear"
