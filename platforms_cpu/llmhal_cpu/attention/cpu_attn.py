"""``cpu_attn``: the CPU platform's default attention backend.

One call serves a whole step (decodes first, then prefills and prefill chunks):

* **KV cache**: one tensor [2, num_blocks, block_size, num_kv_heads, head_size] per layer (the
  shared layout of :mod:`llmhal.attention.paged_kv`), in the model dtype or fp8 (``fp8_e4m3``/
  ``fp8_e5m2``: stored value = real / scale), or packed ``int8``/``nvfp4`` rows (see
  :mod:`llmhal.attention.kv_formats`). The native kernel stores the step's new keys and values in
  the same call that attends; fp8 values are quantized and stored by torch first. The kernel does
  not read packed rows: with ``int8``/``nvfp4`` every request runs through the torch paths below,
  which decode the blocks they gather to the model dtype.
* **Decodes and short query chunks** (up to :data:`KERNEL_MAX_QUERY_LEN` new tokens, e.g. draft
  verification) go to the native kernel (``paged_attention.cpp``): every request in one call,
  threads over (token, key split), each reading its keys straight out of the paged blocks, so
  nothing is gathered or copied. Without a compiler (see :mod:`.native`), the same requests run in
  torch, in groups whose gathered blocks fit in cache, one masked SDPA per group.
* **Prefills** run per request through torch's flash kernel for CPU on views of the cache: a
  request with no cached context attends to its own new keys/values (no gather at all); one with
  context gathers its blocks once (a view when they are consecutive) with a boolean mask for
  causality and the sliding window. Soft-capping uses chunked matmuls (SDPA cannot express it).

Per-step work (masks, block lists, routing) is done once by the builder and shared by all layers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from llmhal.attention import kv_formats, paged_kv
from llmhal.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerState,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from llmhal.attention.reference import first_visible_position, visibility_mask
from llmhal.attention.utils import check_causal
from llmhal.logger import init_logger
from llmhal.utils.openmp import threads_park_quickly
from llmhal_cpu.attention import native, torch_paths

logger = init_logger(__name__)

# Requests with at most this many new tokens are memory-bound: they go to the paged kernel.
KERNEL_MAX_QUERY_LEN = 8
# A key split (for too few (token, head) items to fill the threads) is never shorter than this.
MIN_SPLIT_TOKENS = 256
# Where idle threads park quickly (llmhal's default, see llmhal.utils.openmp) waking the second one
# costs tens of microseconds, so a split also carries at least this many multiply-adds (keys x
# query heads x head size). SmolLM2 (9 x 64) then splits from ~900 keys: its batch-1 decode at a
# 700-token context ran 72 tok/s splitting at 256 keys, 85-90 without a split (2 cores, PASSIVE).
PARKED_SPLIT_WORK = (1 << 19) if threads_park_quickly() else 0


def min_split_tokens(num_heads: int, head_size: int) -> int:
    """The shortest key split worth a second thread for this layer's shape."""
    return max(MIN_SPLIT_TOKENS, -(-PARKED_SPLIT_WORK // (num_heads * head_size)))


@dataclass(frozen=True)
class PrefillSpec:
    """One request served by the torch prefill path (positions are within the request)."""

    req: int
    q_start: int
    q_end: int
    context_len: int  # tokens cached before this step
    seq_len: int  # context_len + new tokens
    blocks: torch.Tensor  # int64 block ids holding positions [0, seq_len)
    first_block: int | None  # set when those blocks are consecutive: a view suffices
    tree: bool  # the step's tree mask applies among the new tokens


@dataclass
class CpuAttentionMetadata:
    """cpu_attn's per-step metadata (built once, shared by every layer of the step)."""

    num_actual_tokens: int
    all_slots: torch.Tensor  # int64 [num_actual_tokens], -1 = padding (for the kernel)
    slot_mapping: torch.Tensor  # int64, slots of the tokens that are written (for torch)
    write_index: torch.Tensor | None  # which tokens are written; None = all of them
    num_kernel_reqs: int  # the leading requests served by the paged kernel
    num_kernel_tokens: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks], contiguous
    prefills: tuple[PrefillSpec, ...]
    tree_mask: torch.Tensor | None
    # Prefill masks depend on the layer's sliding window: built on first use, shared by layers.
    masks: dict[tuple[int, int, int | None], torch.Tensor] = field(default_factory=dict, repr=False)


class CpuAttentionMetadataBuilder(AttentionMetadataBuilder[CpuAttentionMetadata]):
    """Routes requests (kernel or torch path) and resolves their blocks once per step."""

    def build(self, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        check_causal(common, CpuAttentionBackend.name)
        bs = self.requirements.block_size
        qsl_cpu = common.query_start_loc_cpu.tolist()
        seq_cpu = common.seq_lens_cpu.tolist()
        all_slots = common.slot_mapping[: common.num_actual_tokens].to(torch.int64).contiguous()
        slots, write_index = paged_kv.written_slots(all_slots)
        tree_q = None if common.tree_mask is None else int(common.tree_mask.shape[0])
        # The kernel takes the leading run of short requests (decodes come first by contract).
        n_kernel = 0
        while n_kernel < common.num_reqs:
            q_len = qsl_cpu[n_kernel + 1] - qsl_cpu[n_kernel]
            if q_len > KERNEL_MAX_QUERY_LEN or (q_len > 1 and q_len == tree_q):
                break
            n_kernel += 1
        table = common.block_table.to(torch.int32).contiguous()
        prefills = []
        for r in range(n_kernel, common.num_reqs):
            q0, q1 = qsl_cpu[r], qsl_cpu[r + 1]
            if q1 == q0:
                continue
            seq = seq_cpu[r]
            ctx = seq - (q1 - q0)
            prefills.append(self._prefill_spec(r, q0, q1, ctx, seq, table, bs, tree_q))
        return CpuAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            all_slots=all_slots,
            slot_mapping=slots,
            write_index=write_index,
            num_kernel_reqs=n_kernel,
            num_kernel_tokens=qsl_cpu[n_kernel] - qsl_cpu[0],
            query_start_loc=common.query_start_loc_cpu.to(torch.int32).contiguous(),
            seq_lens=common.seq_lens_cpu.to(torch.int32).contiguous(),
            block_table=table,
            prefills=tuple(prefills),
            tree_mask=common.tree_mask,
        )

    def _prefill_spec(
        self,
        r: int,
        q0: int,
        q1: int,
        ctx: int,
        seq: int,
        table: torch.Tensor,
        bs: int,
        tree_q: int | None,
    ) -> PrefillSpec:
        blocks = table[r, : -(-seq // bs)].to(torch.int64)
        first = int(blocks[0])
        consecutive = bool(
            torch.equal(blocks, torch.arange(first, first + len(blocks), dtype=torch.int64))
        )
        return PrefillSpec(
            req=r,
            q_start=q0,
            q_end=q1,
            context_len=ctx,
            seq_len=seq,
            blocks=blocks,
            first_block=first if consecutive else None,
            tree=tree_q is not None and q1 - q0 == tree_q,
        )


class CpuAttentionImpl(AttentionImpl[CpuAttentionMetadata]):
    """One layer's attention on the CPU (see the module docstring for the paths)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if kv_formats.packed_format(self.kv_cache_dtype) is not None:
            # No silent slow path: say once why decodes do not use the native kernel.
            _log_packed_once(self.kv_cache_dtype)

    def forward(
        self,
        layer: AttentionLayerState,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CpuAttentionMetadata,
    ) -> torch.Tensor:
        meta = attn_metadata
        n = meta.num_actual_tokens
        out = torch.empty_like(query)
        if out.shape[0] > n:
            out[n:].zero_()  # padding rows
            query, key, value = query[:n], key[:n], value[:n]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        # The kernel reads rows of head_size contiguous elements (any other stride is fine), in
        # the model dtype or fp8; packed int8/nvfp4 rows are decoded by the torch paths instead.
        packed = kv_formats.stored_format(kv_cache) is not None
        lib = native.load_kernel() if k_cache.stride(-1) == 1 and not packed else None
        # The kernel stores the new keys/values itself (one call, no torch ops) when they are
        # stored as they are; fp8 quantization, and the no-kernel case, go through torch.
        kernel_stores = (
            lib is not None
            and k_cache.dtype == key.dtype
            and key.stride(-1) == value.stride(-1) == 1
        )
        if not kernel_stores:
            self._write(k_cache, key, layer.k_scale, meta)
            self._write(v_cache, value, layer.v_scale, meta)
        if meta.num_kernel_reqs or kernel_stores:
            t = meta.num_kernel_tokens
            if lib is None:
                out[:t] = torch_paths.short_queries(
                    query[:t], k_cache, v_cache, layer.k_scale, layer.v_scale,
                    **self._kernel_args(meta),
                )  # fmt: skip
            else:
                fp8 = k_cache.dtype.itemsize == 1
                native.paged_attention(
                    lib,
                    query=query if t == n else query[:t],
                    k_cache=k_cache,
                    v_cache=v_cache,
                    out=out if t == n else out[:t],
                    num_kv_heads=self.num_kv_heads,
                    k_scale=float(layer.k_scale) if fp8 else 1.0,
                    v_scale=float(layer.v_scale) if fp8 else 1.0,
                    min_split_tokens=min_split_tokens(query.shape[1], query.shape[2]),
                    new_kv=(key, value, meta.all_slots) if kernel_stores else None,
                    **self._kernel_args(meta),
                )
        for spec in meta.prefills:
            rows = slice(spec.q_start, spec.q_end)
            out[rows] = self._prefill(
                layer, spec, query[rows], key[rows], value[rows], kv_cache, meta
            )
        return out

    def _kernel_args(self, meta: CpuAttentionMetadata) -> dict[str, Any]:
        return dict(
            block_table=meta.block_table,
            seq_lens=meta.seq_lens,
            query_start_loc=meta.query_start_loc,
            num_reqs=meta.num_kernel_reqs,
            scale=self.scale,
            soft_cap=self.logits_soft_cap,
            window=self.sliding_window,
        )

    def _write(
        self, cache: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, meta: CpuAttentionMetadata
    ) -> None:
        if meta.write_index is not None:
            x = x[meta.write_index]
        flat = cache.view(-1, self.num_kv_heads, cache.shape[-1])  # a packed row's length
        x = paged_kv.quantize_to_cache(x, cache.dtype, scale)
        if cache.dtype.itemsize == 1:  # index_copy_ has no fp8 kernel; bytes are bytes
            flat, x = flat.view(torch.uint8), x.view(torch.uint8)
        flat.index_copy_(0, meta.slot_mapping, x)

    def _prefill(
        self,
        layer: AttentionLayerState,
        spec: PrefillSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: CpuAttentionMetadata,
    ) -> torch.Tensor:
        """One request's new tokens through torch's flash kernel (or the soft-cap path)."""
        key_start = 0
        # With nothing cached and a cache in the model dtype, the keys are exactly this step's:
        # no need to read them back. Otherwise read the cache (fp8 rounding included).
        if spec.context_len or kv_cache.dtype != q.dtype:
            # Keys before the first query's sliding window are never needed: skip their blocks.
            bs, w = kv_cache.shape[2], self.sliding_window
            key_start = first_visible_position(spec.context_len, w) // bs * bs
            k = self._read(kv_cache[0], spec, key_start, layer.k_scale, q.dtype)
            v = self._read(kv_cache[1], spec, key_start, layer.v_scale, q.dtype)
        mask = self._prefill_mask(spec, key_start, meta)
        out = torch_paths.attend(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            mask,
            scale=self.scale,
            soft_cap=self.logits_soft_cap,
            is_causal=mask is None,
        )
        return out[0].transpose(0, 1)

    def _read(
        self,
        cache: torch.Tensor,
        spec: PrefillSpec,
        key_start: int,
        scale: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Keys (or values) at positions [key_start, seq_len) of one request, in ``dtype``.

        ``key_start`` is a multiple of the block size. Consecutive blocks are a view, not a copy.
        """
        b0 = key_start // cache.shape[1]
        if spec.first_block is not None:
            x = cache[spec.first_block + b0 : spec.first_block + len(spec.blocks)]
        else:
            x = cache.index_select(0, spec.blocks[b0:])
        x = x.view(-1, self.num_kv_heads, cache.shape[-1])[: spec.seq_len - key_start]
        return paged_kv.dequantize_from_cache(x, scale, dtype)

    def _prefill_mask(
        self, spec: PrefillSpec, key_start: int, meta: CpuAttentionMetadata
    ) -> torch.Tensor | None:
        """Visibility of keys [key_start, seq_len) (None: plain causal, SDPA's own mask)."""
        if spec.context_len == 0 and not self.sliding_window and not spec.tree:
            return None
        cache_key = (spec.req, key_start, self.sliding_window)
        mask = meta.masks.get(cache_key)
        if mask is None:
            mask = visibility_mask(
                torch.arange(spec.context_len, spec.seq_len),
                spec.seq_len,
                spec.context_len,
                self.sliding_window,
                meta.tree_mask if spec.tree else None,
            )[:, key_start:]
            meta.masks[cache_key] = mask
        return mask


@functools.cache
def _log_packed_once(kv_cache_dtype: str) -> None:
    logger.info(
        "kv_cache_dtype=%s: cpu_attn's native kernel reads model-dtype and fp8 rows only, so "
        "every request runs its torch paths (decode measured 2-10x slower than the model dtype on "
        "the default model; docs/quantization.md)",
        kv_cache_dtype,
    )


class CpuAttentionBackend(paged_kv.SharedKVLayout, AttentionBackend):
    """Paged attention for CPUs: native kernel for decodes, torch flash kernel for prefills."""

    name = "cpu_attn"
    kind = "mha"
    supported_dtypes = ("float32", "bfloat16", "float16")
    supported_head_sizes = None
    supported_block_sizes = None
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2", "int8", "nvfp4")
    supported_attn_types = ("decoder",)
    supports_sliding_window = True
    supports_logits_soft_cap = True

    @staticmethod
    def get_impl_cls() -> type[CpuAttentionImpl]:
        return CpuAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[CpuAttentionMetadataBuilder]:
        return CpuAttentionMetadataBuilder
