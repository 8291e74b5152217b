"""The vendor entry point ``rocm_aiter_fa`` calls, with its upstream signature.

Transcribed from ROCm/aiter 0.1.20 (``aiter/ops/mha.py``). Note ``min_seqlen_q`` in the eighth
position, where flash-attention has ``dropout_p``: arguments after ``max_seqlen_k`` must be passed
by keyword. Test fakes bind every call to this signature
(:func:`llmhal.testing.signatures.bound_to`). Only the signature matters.
"""

from __future__ import annotations

from typing import Any

ENTRY_POINTS: dict[str, tuple[str, str]] = {
    "flash_attn_varlen_func": ("aiter", "flash_attn_varlen_func"),
}


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, min_seqlen_q=0,
    dropout_p=0.0, softmax_scale=None, logits_soft_cap=0.0, causal=False,
    window_size=(-1, -1, 0), bias=None, alibi_slopes=None, deterministic=False, return_lse=False,
    return_attn_probs=False, how_v3_bf16_cvt=1, block_table=None, out=None,
    cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, sink_ptr=None,
) -> Any: ...  # fmt: skip
