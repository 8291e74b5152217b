"""The Triton kernel of ``triton_mla``: absorbed-form MLA decode over the paged latent cache.

One program per (decode request, tile of ``BLOCK_H`` heads). The heads of a request share every
cached latent (MQA with one wide head), so a program loads each tile of ``BLOCK_N`` cached tokens
once for all its heads and runs two ``tl.dot`` per tile: scores ``q_lat . c + q_pe . k_pe`` and the
latent-space output ``p @ c``, with an online softmax in float32 across tiles. ``W_UK``/``W_UV``
stay outside (batched matmuls in torch before and after), as in vLLM's Triton MLA decode.

Importing this module imports triton; ``TRITON_INTERPRET=1`` must be set before the first import to
run on the CPU interpreter (tests), which computes float32 faithfully.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 16  # tl.dot needs every tile dimension >= 16
BLOCK_N = 16


@triton.jit
def _mla_decode_kernel(
    out_ptr,  # float32 [B, H, L]
    q_ptr,  # [B, H, L + R]: q_lat then q_pe
    cache_ptr,  # [num_blocks * block_size, L + R]
    block_table_ptr,  # int32 [B, max_blocks]
    seq_lens_ptr,  # int32 [B]
    k_scale_ptr,  # float32 scalar (fp8 caches)
    scale,
    num_heads,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_bt,
    block_size,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H
    heads = h0 + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    lmask = offs_l < L
    rmask = offs_r < R
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_row + offs_l[None, :], mask=hmask[:, None] & lmask[None, :], other=0.0)
    q_r = tl.load(q_row + L + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    q_c = q_c.to(tl.float32)
    q_r = q_r.to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + b)
    k_scale = tl.load(k_scale_ptr)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        nmask = pos < seq_len
        blk = tl.load(block_table_ptr + b * stride_bt + pos // block_size, mask=nmask, other=0)
        slot = blk.to(tl.int64) * block_size + pos % block_size
        row = cache_ptr + slot[:, None] * (L + R)
        c = tl.load(row + offs_l[None, :], mask=nmask[:, None] & lmask[None, :], other=0.0)
        kpe = tl.load(row + L + offs_r[None, :], mask=nmask[:, None] & rmask[None, :], other=0.0)
        c = c.to(tl.float32)
        kpe = kpe.to(tl.float32)
        if IS_FP8:
            c = c * k_scale
            kpe = kpe * k_scale
        if IEEE:
            s = tl.dot(q_c, tl.trans(c), input_precision="ieee")
            s += tl.dot(q_r, tl.trans(kpe), input_precision="ieee")
        else:
            s = tl.dot(q_c, tl.trans(c)) + tl.dot(q_r, tl.trans(kpe))
        s = s * scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, c, input_precision="ieee")
        else:
            pv = tl.dot(p, c)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    acc = acc / l_i[:, None]
    o_row = out_ptr + b * stride_ob + heads[:, None] * stride_oh
    tl.store(o_row + offs_l[None, :], acc, mask=hmask[:, None] & lmask[None, :])


def mla_decode(
    q_lat: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scale: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    ieee: bool,
) -> torch.Tensor:
    """Latent-space attention output (float32 [B, H, kv_lora_rank]) of decode queries ``q_lat``
    [B, H, L + R] over the latent cache ``[num_blocks, block_size, L + R]``."""
    b, h, width = q_lat.shape
    r = width - kv_lora_rank
    out = torch.empty(b, h, kv_lora_rank, dtype=torch.float32, device=q_lat.device)
    q_lat = q_lat.contiguous()
    table = block_table.to(torch.int32).contiguous()
    grid = (b, triton.cdiv(h, BLOCK_H))
    _mla_decode_kernel[grid](
        out, q_lat, kv_cache, table, seq_lens.to(torch.int32).contiguous(),
        k_scale.to(torch.float32), scale, h,
        q_lat.stride(0), q_lat.stride(1), out.stride(0), out.stride(1), table.stride(0),
        kv_cache.shape[1],
        L=kv_lora_rank, R=r,
        BLOCK_L=max(16, triton.next_power_of_2(kv_lora_rank)),
        BLOCK_R=max(16, triton.next_power_of_2(r)),
        BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        IS_FP8=kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2),
        IEEE=ieee,
    )  # fmt: skip
    return out
