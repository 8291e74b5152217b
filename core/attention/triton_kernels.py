"""Triton kernels for paged attention: one launch serves a whole varlen step (prefill + decode).

Reusable by any backend whose cache can be described as two strided tensors
``k_cache``/``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_size]`` (any strides,
the last dimension contiguous): ``triton_attn`` passes views of the shared layout of
:mod:`llmhal.attention.paged_kv`; another backend may pass views of its own layout.

* :func:`plan_query_tiles` splits every request's new tokens into tiles of ``block_q`` tokens (host
  side, once per step);
* :func:`unified_attention` launches :func:`unified_attention_kernel` with one program per
  (query tile, KV head). A program holds the ``block_q`` tokens x ``num_heads // num_kv_heads``
  query heads that share the KV head as the rows of one matrix, walks the request's block table
  one cache block at a time (only the blocks its rows can see: causal end, sliding-window start)
  and keeps an online softmax in float32.

Importing this module imports triton and decorates the kernel. Triton reads ``TRITON_INTERPRET`` at
decoration time: set ``TRITON_INTERPRET=1`` *before* the first import to run on the CPU
interpreter. The interpreter computes bf16 arithmetic and bf16/fp8 stores incorrectly, so there
the kernel upcasts every tile to float32 (``COMPUTE_FP32``) and writes a float32 output that the
host casts (:func:`interpreter_active`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpreter_active() -> bool:
    """True when kernels decorated by this module run in Triton's CPU interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(unified_attention_kernel, InterpretedFunction)


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): saturates to +-1 without overflow trouble, and needs no libdevice.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def unified_attention_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    block_table_ptr,  # int32 [num_reqs, max_blocks]
    query_start_ptr,  # int32 [num_reqs + 1]
    seq_lens_ptr,  # int32 [num_reqs]
    positions_ptr,  # int64 [T]
    tile_req_ptr,  # int32 [num_tiles]: request of each query tile
    tile_qoff_ptr,  # int32 [num_tiles]: first new token of the tile within its request
    k_scale_ptr,  # float32 scalar (fp8 caches)
    v_scale_ptr,
    scale,
    soft_cap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # rows: next power of two of BLOCK_Q * GROUP (at least 16)
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    KV_FP8: tl.constexpr,
    COMPUTE_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    q_off = tl.load(tile_qoff_ptr + tile)
    q_begin = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + req)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_n = tl.arange(0, BLOCK_SIZE)
    tok = q_off + offs_m // GROUP  # token index within the request
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    d_ok = offs_d < HEAD_SIZE

    q_rows = q_begin + tok
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if COMPUTE_FP32:
        q = q.to(tl.float32)
    qpos = tl.load(positions_ptr + q_rows, mask=row_ok, other=0)

    # The blocks any row can see: up to the last row's position; from the first row's window.
    last = tl.minimum(tl.max(tl.where(row_ok, qpos, -1)) + 1, seq_len)
    first = 0
    if USE_WINDOW:
        first = tl.maximum(tl.min(tl.where(row_ok, qpos, seq_len)) - window + 1, 0)
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    for j in range(first // BLOCK_SIZE, (last + BLOCK_SIZE - 1) // BLOCK_SIZE):
        phys = tl.load(block_table_ptr + req * stride_bt + j).to(tl.int64)
        kpos = j * BLOCK_SIZE + offs_n
        k_ok = kpos < seq_len
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_cache_ptr
            + phys * stride_kb
            + offs_n[:, None] * stride_ks
            + kv_head * stride_kh
            + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + phys * stride_vb
            + offs_n[:, None] * stride_vs
            + kv_head * stride_vh
            + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if KV_FP8:
            k = k.to(tl.float32) * k_scale
            v = v.to(tl.float32) * v_scale
            if not COMPUTE_FP32:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
        elif COMPUTE_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        if COMPUTE_FP32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        visible = row_ok[:, None] & k_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        if USE_WINDOW:
            visible = visible & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if COMPUTE_FP32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def block_q_for(group: int, min_rows: int = 16) -> int:
    """Query tokens per tile so that a tile has at least ``min_rows`` rows (tokens x group)."""
    return max(1, min_rows // group)


def plan_query_tiles(
    query_start_loc_cpu: torch.Tensor, block_q: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_req, tile_qoff), int32: the request and first token offset of every query tile."""
    q_lens = (query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]).long()
    tiles = (q_lens + block_q - 1) // block_q
    tile_req = torch.repeat_interleave(torch.arange(q_lens.shape[0]), tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles
    tile_qoff = (torch.arange(int(tiles.sum())) - first_tile[tile_req]) * block_q
    return tile_req.to(device, torch.int32), tile_qoff.to(device, torch.int32)


def unified_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    tile_req: torch.Tensor,
    tile_qoff: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    scale: float,
    *,
    block_q: int,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    compute_fp32: bool | None = None,
) -> torch.Tensor:
    """Attention of every new token of a step over its request's paged keys/values.

    ``out``/``query`` are [T, H, D]; ``k_cache``/``v_cache`` [num_blocks, block_size, Hkv, D] with
    the last dimension contiguous, holding this step's keys already (write first). ``tile_req``/
    ``tile_qoff`` come from :func:`plan_query_tiles` with the same ``block_q``. ``compute_fp32``
    (default: for float32 queries, and always in the interpreter) upcasts every tile to float32
    and uses IEEE float32 dots (no TF32). Returns ``out``.
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    kv_fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if compute_fp32 is None:
        compute_fp32 = interpreter_active() or query.dtype == torch.float32
    if tile_req.numel() == 0:
        return out
    block_m = max(16, triton.next_power_of_2(block_q * group))
    head_pad = max(16, triton.next_power_of_2(head_size))
    grid = (tile_req.numel(), num_kv_heads)
    unified_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_table,
        query_start_loc,
        seq_lens,
        positions,
        tile_req,
        tile_qoff,
        k_scale,
        v_scale,
        scale,
        float(logits_soft_cap or 0.0),
        int(sliding_window or 0),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        USE_WINDOW=bool(sliding_window),
        USE_SOFT_CAP=bool(logits_soft_cap),
        KV_FP8=kv_fp8,
        COMPUTE_FP32=compute_fp32,
    )
    return out
