"""``mamba2_attn``: the backend of Mamba-2 mixers (Mamba2, and the Mamba layers of hybrids).

A Mamba-2 layer keeps a conv state ``[conv_kernel - 1, intermediate + 2 * groups * state_size]``
and an SSM state ``[heads, head_dim, state_size]`` per request. Prefills run the chunked SSD scan
with the chunk boundaries the op derives from ``prefill_query_start_loc`` and the model's
``chunk_size``; decodes run one state update. The computation lives in
:class:`llmhal.layers.mamba2_mixer.Mamba2Mixer`.
"""

from __future__ import annotations

from llmhal.attention.state import RecurrentBackend


class Mamba2AttentionBackend(RecurrentBackend):
    name = "mamba2_attn"
    kind = "mamba2"
