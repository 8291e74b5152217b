"""Split-KV paged decode attention in Triton: the decode path of ``rocm_attn``.

Decodes have one query token per request, so one program per (request, KV head) would leave most of
an MI300's 304 compute units idle on small batches with long contexts. The KV range of every request
is therefore cut into splits of ``pages_per_split`` pages; each (request, KV head, split) program
computes, for all the query heads that share that KV head, a partial softmax (running max,
denominator and weighted sum, in float32) with two matrix products per page, and a second kernel
merges the splits of each (request, query head) with the usual log-sum-exp rescaling.

Masking follows ``llmhal.attention.backend``: the query sits at position ``seq_len - 1`` and sees
keys ``seq_len - 1 - W < k <= seq_len - 1`` with a sliding window ``W``; a soft-cap ``c`` maps a
score ``s`` to ``c * tanh(s / c)``. Cache values are read through the shared paged layout and, for
fp8 caches, multiplied by the layer's scale. Products take the model dtype with float32 accumulation
(float32 throughout for float32 models and in Triton's interpreter, which mishandles bf16); the
softmax statistics are always float32.

This module imports Triton at import time; ``rocm_attn`` imports it on first use only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

DEFAULT_PAGES_PER_SPLIT = 16
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
MAX_SPLITS = 64  # the merge kernel holds every split of a row in registers
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)


@triton.jit
def _tanh(x):
    # tanh without libdevice (portable across the CUDA, HIP and interpreter backends).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, H, D]
    k_ptr,  # [num_blocks, block_size, KVH, D]
    v_ptr,
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    acc_ptr,  # [B, H, S, HEAD_PAD] float32
    max_ptr,  # [B, H, S] float32
    sum_ptr,  # [B, H, S] float32
    k_scale_ptr,
    v_scale_ptr,
    scale,
    soft_cap,
    window,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_bt,
    num_heads,
    num_splits,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # >= 16: the M side of tl.dot
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
    PAGES_PER_SPLIT: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DEQUANT: tl.constexpr,  # fp8 cache: multiply by the layer's scales
    COMPUTE: tl.constexpr,  # dtype fed to tl.dot (float32 in the interpreter / for fp32 models)
):
    # One program serves every query head of one KV head (GQA), so K/V pages are read once per
    # group and the scores are a [GROUP_PAD, BLOCK_PAD] matrix product.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    first = 0
    if USE_WINDOW:
        first = tl.maximum(seq_len - window, 0)

    g = tl.arange(0, GROUP_PAD)
    g_ok = g < GROUP
    heads = kvh * GROUP + g
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_SIZE
    q_off = b * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(COMPUTE)
    k_scale = tl.load(k_scale_ptr).to(tl.float32)
    v_scale = tl.load(v_scale_ptr).to(tl.float32)

    t = tl.arange(0, BLOCK_PAD)
    m_i = tl.full([GROUP_PAD], -float("inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    page_lo = split * PAGES_PER_SPLIT
    for i in range(PAGES_PER_SPLIT):
        page = page_lo + i
        pos = page * BLOCK_SIZE + t
        ok = (t < BLOCK_SIZE) & (pos < seq_len) & (pos >= first)
        if tl.sum(ok.to(tl.int32), axis=0) > 0:
            block = tl.load(block_table_ptr + b * stride_bt + page).to(tl.int64)
            off = block * stride_kb + t[:, None] * stride_kt + kvh * stride_kh + d[None, :]
            tile_ok = ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + off, mask=tile_ok, other=0.0)
            v = tl.load(v_ptr + off, mask=tile_ok, other=0.0)
            if DEQUANT:
                k = k.to(tl.float32) * k_scale
                v = v.to(tl.float32) * v_scale
            # "ieee": Triton's HIP backend accepts "tf32" on gfx942 only (every other AMD arch
            # refuses to compile), and for bf16/fp16 operands the choice changes nothing.
            s = tl.dot(q, tl.trans(k.to(COMPUTE)), input_precision="ieee") * scale
            if USE_SOFT_CAP:
                s = soft_cap * _tanh(s / soft_cap)
            s = tl.where(ok[None, :], s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            pv = tl.dot(p.to(COMPUTE), v.to(COMPUTE), input_precision="ieee")
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
    rows = (b * num_heads + heads) * num_splits + split
    tl.store(acc_ptr + rows[:, None] * HEAD_PAD + d[None, :], acc, mask=g_ok[:, None])
    tl.store(max_ptr + rows, m_i, mask=g_ok)
    tl.store(sum_ptr + rows, l_i, mask=g_ok)


def interpreter_active() -> bool:
    """True when this module's kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` was
    set when it was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_decode_split_kernel, InterpretedFunction)


@triton.jit
def _merge_kernel(
    acc_ptr,  # [B, H, S, HEAD_PAD] float32
    max_ptr,  # [B, H, S]
    sum_ptr,
    out_ptr,  # [B, H, D]
    stride_ob,
    stride_oh,
    num_splits,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row0 = (b * tl.num_programs(1) + h) * num_splits
    s = tl.arange(0, SPLIT_PAD)
    s_ok = s < num_splits
    m = tl.load(max_ptr + row0 + s, mask=s_ok, other=-float("inf"))
    denoms = tl.load(sum_ptr + row0 + s, mask=s_ok, other=0.0)
    m_all = tl.max(m, axis=0)
    # A row that sees no key at all (every split empty) outputs zeros.
    w = tl.where(m > -float("inf"), tl.exp(m - m_all), 0.0)
    denom = tl.sum(w * denoms, axis=0)
    d = tl.arange(0, HEAD_PAD)
    acc = tl.load(
        acc_ptr + (row0 + s[:, None]) * HEAD_PAD + d[None, :], mask=s_ok[:, None], other=0.0
    )
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + d,
        o.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_SIZE,
    )


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch as :func:`paged_decode` makes it: ``kernel[grid](*args, **constexprs)``.

    Kept as data so that tests and ``ci/gpu-check`` compile exactly what a step would launch, for
    any target, without a GPU (see :mod:`llmhal_rocm.attention.aot`)."""

    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]
    constexprs: dict[str, Any]

    def __call__(self) -> None:
        self.kernel[self.grid](**self.args, **self.constexprs)


def decode_launches(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    pages_per_split: int = DEFAULT_PAGES_PER_SPLIT,
    interpreted: bool | None = None,
) -> tuple[torch.Tensor, list[KernelLaunch]]:
    """(output buffer, the split and merge launches) for :func:`paged_decode`'s arguments."""
    num_reqs, num_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if interpreted is None:
        interpreted = interpreter_active()
    # The interpreter stores bf16/fp16 wrongly: it writes float32 and the result is cast after.
    out = torch.empty_like(query, dtype=torch.float32 if interpreted else query.dtype)
    if num_reqs == 0:
        return out, []
    max_pages = max(1, triton.cdiv(max_seq_len, block_size))
    # Fewer, longer splits when the context is very long: the merge holds MAX_SPLITS at most.
    pages_per_split = max(pages_per_split, triton.cdiv(max_pages, MAX_SPLITS))
    num_splits = triton.cdiv(max_pages, pages_per_split)
    head_pad = triton.next_power_of_2(head_size)
    dev = query.device
    acc = torch.empty(num_reqs, num_heads, num_splits, head_pad, dtype=torch.float32, device=dev)
    mx = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32, device=dev)
    sm = torch.empty_like(mx)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    q = query.contiguous()
    table = block_table.contiguous()
    # Pages past a request's table width are never loaded (their positions exceed seq_len), but
    # the table must be wide enough for the split grid's page arithmetic to stay in bounds.
    if table.shape[1] < num_splits * pages_per_split:
        pad = num_splits * pages_per_split - table.shape[1]
        table = torch.nn.functional.pad(table, (0, pad))
    group = num_heads // num_kv_heads
    # tl.dot takes bf16/fp16 on the device with fp32 accumulation; float32 models (and the
    # interpreter, whose bf16 arithmetic is unreliable) use float32 products.
    exact = query.dtype == torch.float32 or interpreted
    split = KernelLaunch(
        _decode_split_kernel,
        (num_reqs, num_kv_heads, num_splits),
        dict(
            q_ptr=q,
            k_ptr=k_cache,
            v_ptr=v_cache,
            block_table_ptr=table,
            seq_lens_ptr=seq_lens,
            acc_ptr=acc,
            max_ptr=mx,
            sum_ptr=sm,
            k_scale_ptr=k_scale,
            v_scale_ptr=v_scale,
            scale=float(scale),
            soft_cap=float(logits_soft_cap or 0.0),
            window=int(sliding_window or 0),
            stride_qb=q.stride(0),
            stride_qh=q.stride(1),
            stride_kb=k_cache.stride(0),
            stride_kt=k_cache.stride(1),
            stride_kh=k_cache.stride(2),
            stride_bt=table.stride(0),
            num_heads=num_heads,
            num_splits=num_splits,
        ),
        dict(
            GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)),
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            BLOCK_SIZE=block_size,
            BLOCK_PAD=triton.next_power_of_2(block_size),
            PAGES_PER_SPLIT=pages_per_split,
            USE_SOFT_CAP=bool(logits_soft_cap),
            USE_WINDOW=bool(sliding_window),
            DEQUANT=kv_cache.dtype in FP8_DTYPES,
            COMPUTE=tl.float32 if exact else _TL_DTYPES[query.dtype],
        ),
    )
    merge = KernelLaunch(
        _merge_kernel,
        (num_reqs, num_heads),
        dict(
            acc_ptr=acc,
            max_ptr=mx,
            sum_ptr=sm,
            out_ptr=out,
            stride_ob=out.stride(0),
            stride_oh=out.stride(1),
            num_splits=num_splits,
        ),
        dict(HEAD_SIZE=head_size, HEAD_PAD=head_pad, SPLIT_PAD=triton.next_power_of_2(num_splits)),
    )
    return out, [split, merge]


def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    pages_per_split: int = DEFAULT_PAGES_PER_SPLIT,
) -> torch.Tensor:
    """Attention of one query token per request over its paged KV history.

    ``query`` [B, H, D]; ``kv_cache`` in the shared layout ``[2, blocks, block_size, KVH, D]``;
    ``block_table`` int32 [B, max_blocks]; ``seq_lens`` int32 [B] (including the query token, whose
    key/value must already be in the cache). Returns [B, H, D] in the query's dtype.
    """
    out, launches = decode_launches(
        query,
        kv_cache,
        block_table,
        seq_lens,
        max_seq_len,
        scale,
        k_scale,
        v_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        pages_per_split=pages_per_split,
    )
    for launch in launches:
        launch()
    return out.to(query.dtype)
