"""cpu_attn's pure-torch paths: prefill through SDPA, and decode when the native kernel is missing.

Prefill is compute-bound, so torch's flash kernel for CPU (``scaled_dot_product_attention``, which
takes strided views and a boolean mask) is the right tool; with logits soft-capping, which SDPA
cannot express, scores are computed with batched matmuls in query chunks of bounded memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmhal.attention import paged_kv

# Upper bound of one score chunk in the soft-cap path, in elements (256 MiB of fp32).
_SCORE_CHUNK_ELEMS = 1 << 26


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float,
    soft_cap: float | None,
    is_causal: bool = False,
) -> torch.Tensor:
    """Attention over dense (possibly strided) tensors, GQA included.

    ``q`` is [N, Hq, Lq, D]; ``k``/``v`` are [N, Hkv, Lk, D]; ``mask`` is a boolean (True = may
    attend) broadcastable to [N, 1, Lq, Lk], or None. ``is_causal`` (only with ``mask=None``) means
    query i sees keys j <= i. Every query must see at least one key. Returns [N, Hq, Lq, D].
    """
    n, hq, lq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    if soft_cap is None:
        if lq == 1 and g > 1:
            # A single query per sequence: the query heads of a KV head become its query rows, so
            # each key is read once per KV head instead of once per query head.
            out = F.scaled_dot_product_attention(
                q.reshape(n, hkv, g, d), k, v, attn_mask=mask, scale=scale
            )
            return out.reshape(n, hq, 1, d)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=g > 1
        )
    if is_causal:
        lk = k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril_(lk - lq)
    return _soft_capped(q, k, v, mask, scale, soft_cap)


def _soft_capped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float,
) -> torch.Tensor:
    n, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(n, hkv, g, lq, d).to(torch.float32)
    kf = k.to(torch.float32).unsqueeze(2)  # [n, hkv, 1, lk, d]
    vf = v.to(torch.float32).unsqueeze(2)
    m = None if mask is None else mask.expand(n, 1, lq, lk).unsqueeze(1)  # [n, 1, 1, lq, lk]
    out = torch.empty(n, hkv, g, lq, d, dtype=torch.float32, device=q.device)
    step = max(1, _SCORE_CHUNK_ELEMS // max(1, n * hq * lk))
    for s in range(0, lq, step):
        e = min(lq, s + step)
        scores = torch.matmul(qg[:, :, :, s:e], kf.transpose(-1, -2)).mul_(scale / soft_cap)
        scores = scores.tanh_().mul_(soft_cap)
        if m is not None:
            scores.masked_fill_(~m[..., s:e, :], float("-inf"))
        torch.matmul(scores.softmax(-1), vf, out=out[:, :, :, s:e])
    return out.reshape(n, hq, lq, d).to(q.dtype)


def visible(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility of keys at ``kpos`` from queries at ``qpos``."""
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    return mask


def short_queries(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    max_seq_len: int,
    scale: float,
    soft_cap: float | None,
    window: int | None,
) -> torch.Tensor:
    """The native kernel's job without it: every request at once, vectorised over the batch.

    Gathers the requests' blocks (one copy), pads every request to the longest query and context,
    and runs one masked attention. Arguments as in :func:`llmhal_cpu.attention.native.paged_attention`;
    returns [tokens, num_heads, head_size].
    """
    r = num_reqs
    _, bs, hkv, d = k_cache.shape
    nblk = -(-max_seq_len // bs)
    blocks = block_table[:r, :nblk].to(torch.int64).flatten()
    lk = nblk * bs
    k = paged_kv.dequantize_from_cache(
        k_cache.index_select(0, blocks).view(r, lk, hkv, d), k_scale, query.dtype
    )
    v = paged_kv.dequantize_from_cache(
        v_cache.index_select(0, blocks).view(r, lk, hkv, d), v_scale, query.dtype
    )
    qsl = query_start_loc[: r + 1].to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    rows = torch.arange(int(q_lens.max()))
    # Row i of request j is its token qsl[j] + i (padding rows repeat its first token).
    valid = rows[None, :] < q_lens[:, None]
    tok = torch.where(valid, qsl[:-1, None] + rows[None, :], qsl[:-1, None])
    q = query[tok.flatten()].view(r, len(rows), query.shape[1], d)
    pos = seq_lens[:r, None].to(torch.int64) - q_lens[:, None] + rows[None, :]
    mask = visible(pos[:, :, None], torch.arange(lk)[None, None, :], window)[:, None]
    out = attend(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        mask,
        scale=scale,
        soft_cap=soft_cap,
    )
    return out.transpose(1, 2)[valid]
