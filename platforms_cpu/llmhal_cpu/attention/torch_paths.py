"""cpu_attn's pure-torch paths: prefill through SDPA, and decode when the native kernel is missing.

Prefill is compute-bound, so torch's flash kernel for CPU (``scaled_dot_product_attention``, which
takes strided views and a boolean mask) is the right tool; with logits soft-capping, which SDPA
cannot express, scores are computed with batched matmuls in query chunks of bounded memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmhal.attention import paged_kv
from llmhal.attention.reference import causal_window_mask, first_visible_position

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
    scale: float,
    soft_cap: float | None,
    window: int | None,
) -> torch.Tensor:
    """The native kernel's job without it: requests in groups, each group vectorised.

    A group of consecutive requests gathers its blocks (from the first one its sliding window
    needs) into one padded copy of at most :data:`_GATHER_BUDGET_ELEMS` keys' elements, small
    enough to stay in cache for the masked attention that follows. Arguments as in
    :func:`llmhal_cpu.attention.native.paged_attention`; returns [tokens, num_heads, head_size].
    """
    _, bs, hkv, d = k_cache.shape
    seq = seq_lens[:num_reqs].tolist()
    qsl = query_start_loc[: num_reqs + 1].tolist()
    # The first block each request's first query can see (its sliding window's start).
    first = [
        first_visible_position(s - (qsl[j + 1] - qsl[j]), window) // bs for j, s in enumerate(seq)
    ]
    parts = []
    start = 0
    while start < num_reqs:
        end, nblk = start + 1, -(-seq[start] // bs) - first[start]
        while end < num_reqs:
            grown = max(nblk, -(-seq[end] // bs) - first[end])
            if grown * bs * hkv * d * (end + 1 - start) > _GATHER_BUDGET_ELEMS:
                break
            nblk, end = grown, end + 1
        parts.append(
            _short_group(
                query[qsl[start] - qsl[0] : qsl[end] - qsl[0]],
                k_cache,
                v_cache,
                k_scale,
                v_scale,
                block_table[start:end],
                torch.tensor(first[start:end]),
                nblk,
                seq_lens[start:end],
                query_start_loc[start : end + 1],
                scale=scale,
                soft_cap=soft_cap,
                window=window,
            )
        )
        start = end
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# Keys' elements gathered at once by the pure-torch short-query path (K and V each: 8 MiB fp32).
_GATHER_BUDGET_ELEMS = 1 << 21


def _short_group(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_table: torch.Tensor,
    first_block: torch.Tensor,
    nblk: int,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    soft_cap: float | None,
    window: int | None,
) -> torch.Tensor:
    r = block_table.shape[0]
    _, bs, hkv, d = k_cache.shape
    # Block j of request i's gathered keys is its logical block first_block[i] + j (clamped past
    # the end of its table row: those keys are masked out anyway).
    logical = (first_block[:, None] + torch.arange(nblk)[None, :]).clamp_(
        max=block_table.shape[1] - 1
    )
    blocks = block_table.to(torch.int64).gather(1, logical).flatten()
    lk = nblk * bs
    k = paged_kv.dequantize_from_cache(
        k_cache.index_select(0, blocks).view(r, lk, hkv, d), k_scale, query.dtype
    )
    v = paged_kv.dequantize_from_cache(
        v_cache.index_select(0, blocks).view(r, lk, hkv, d), v_scale, query.dtype
    )
    qsl = query_start_loc.to(torch.int64) - int(query_start_loc[0])
    q_lens = qsl[1:] - qsl[:-1]
    rows = torch.arange(int(q_lens.max()))
    # Row i of request j is its token qsl[j] + i (padding rows repeat its first token).
    valid = rows[None, :] < q_lens[:, None]
    tok = torch.where(valid, qsl[:-1, None] + rows[None, :], qsl[:-1, None])
    # The query keeps its own head size (d is the cache row, longer or shorter when packed).
    q = query[tok.flatten()].view(r, len(rows), *query.shape[1:])
    qpos = seq_lens[:, None].to(torch.int64) - q_lens[:, None] + rows[None, :]  # [r, lq]
    kpos = first_block[:, None] * bs + torch.arange(lk)[None, :]  # [r, lk]
    mask = causal_window_mask(qpos[:, :, None], kpos[:, None, :], window)[:, None]
    out = attend(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        mask,
        scale=scale,
        soft_cap=soft_cap,
    )
    return out.transpose(1, 2)[valid]
