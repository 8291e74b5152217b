"""``short_conv_attn``: the backend of gated short convolutions (LFM2's ``conv`` layers).

A short-convolution layer keeps one conv state per request, ``[kernel - 1, hidden]``: the last
inputs its depthwise causal convolution needs to continue. Prefills run ``causal_conv1d_fn`` over
the prefill requests (``prefill_query_start_loc``, each from zeros or from its slot), decodes run
``causal_conv1d_update``; the computation lives in :class:`llmhal.layers.short_conv.ShortConv`.
"""

from __future__ import annotations

from llmhal.attention.state import RecurrentBackend


class ShortConvAttentionBackend(RecurrentBackend):
    name = "short_conv_attn"
    kind = "short_conv"
