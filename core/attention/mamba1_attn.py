"""``mamba1_attn``: the backend of Mamba-1 mixers (Mamba, FalconMamba).

A Mamba-1 layer keeps a conv state ``[conv_kernel - 1, intermediate]`` and an SSM state
``[intermediate, state_size]`` per request; its builder is the shared recurrent one (state slots,
which requests prefill, their chunk boundaries). The computation runs in
:class:`llmhal.layers.mamba_mixer.MambaMixer` through the ``mamba_ops`` custom ops.
"""

from __future__ import annotations

from llmhal.attention.state import RecurrentBackend


class Mamba1AttentionBackend(RecurrentBackend):
    name = "mamba1_attn"
    kind = "mamba1"
