"""The shared paged KV-cache layout and its fp8 storage rule.

Layout (used by ``reference``, ``tree_attn``, ``triton_attn`` and the platform backends that mix in
:class:`SharedKVLayout`; other backends, e.g. ``flex_attention``, choose their own): one tensor
``[2, num_blocks, block_size, num_kv_heads, head_size]``, keys at index 0 and values at index 1.
Slot ``s`` is ``(s // block_size, s % block_size)``, so ``kv_cache[i].view(-1, num_kv_heads,
head_size)[s]`` is the key (``i = 0``) or value (``i = 1``) of the token stored in slot ``s``.

fp8 storage (``kv_cache_dtype`` ``fp8_e4m3``/``fp8_e5m2``): a value ``x`` is stored as
``fp8(clamp(x / scale))`` computed in float32, saturating at the fp8 type's largest finite value
(a plain cast would turn overflow into NaN for e4m3fn); a stored ``q`` reads back as ``q * scale``.
``scale`` is the layer's ``k_scale``/``v_scale``.

Packed formats (``int8``, ``nvfp4``; :mod:`llmhal.attention.kv_formats`) keep this layout with a
longer or shorter last dimension (a row holds its values and their scales), so ``head_size`` above
is then :func:`llmhal.attention.kv_formats.row_size`; the helpers below read and write them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmhal.attention import kv_formats

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.attention.backend import AttentionLayerState, CommonAttentionMetadata


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, ...]:
    """The shape of one layer's cache in the shared layout."""
    return (2, num_blocks, block_size, num_kv_heads, head_size)


class SharedKVLayout:
    """Mixin for attention backends that store their cache in this module's layout: put it before
    ``AttentionBackend`` in the bases to provide ``get_kv_cache_shape``."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: str = "auto",
    ) -> tuple[int, ...]:
        from llmhal.attention.kv_formats import row_size

        return kv_cache_shape(
            num_blocks, block_size, num_kv_heads, row_size(cache_dtype, head_size)
        )


def quantize_to_cache(
    x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor
) -> torch.Tensor:
    """``x`` as it is stored in a cache of ``cache_dtype`` (scaled and saturated when fp8; rows of
    the packed format of that element type when int8/uint8)."""
    if cache_dtype in (torch.int8, torch.uint8):
        return kv_formats.encode(x, cache_dtype, scale)
    if cache_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x.to(cache_dtype)
    fmax = torch.finfo(cache_dtype).max
    return (x.float() / scale.float()).clamp(-fmax, fmax).to(cache_dtype)


def dequantize_from_cache(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Stored cache values as ``dtype`` (fp8 values are multiplied by ``scale`` in float32; packed
    rows are decoded, so the last dimension becomes the head size)."""
    if kv_formats.stored_format(x) is not None:
        return kv_formats.decode(x, scale, dtype)
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return (x.float() * scale.float()).to(dtype)
    return x.to(dtype)


def written_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The int64 slots of the tokens a step stores (-1 marks padding, which is not stored), and
    the indices of those tokens (None when every token is stored: no gather needed)."""
    slots = slot_mapping.to(torch.int64)
    if slots.numel() and bool((slots < 0).any()):
        index = torch.nonzero(slots >= 0).flatten()
        return slots[index], index
    return slots, None


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ([T, num_kv_heads, head_size]) at ``slot_mapping`` (-1 = skip)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    slots, index = written_slots(slot_mapping)
    key, value = key[:n], value[:n]
    if index is not None:
        key, value = key[index], value[index]
    kv_heads, head_size = kv_cache.shape[-2], kv_cache.shape[-1]
    k_flat = kv_cache[0].view(-1, kv_heads, head_size)
    v_flat = kv_cache[1].view(-1, kv_heads, head_size)
    k_flat[slots] = quantize_to_cache(key, kv_cache.dtype, k_scale)
    v_flat[slots] = quantize_to_cache(value, kv_cache.dtype, v_scale)


def store_and_allocate(
    layer: AttentionLayerState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Write the step's keys/values into the paged cache and return a zeroed output for ``query``
    (rows past ``len(slot_mapping)`` are padding and stay zero, as the contract requires)."""
    n = slot_mapping.shape[0]
    write_kv(kv_cache, key[:n], value[:n], slot_mapping, layer.k_scale, layer.v_scale)
    return torch.zeros_like(query)


def slots_of(
    block_table_row: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Cache slots of ``positions`` for a request with the given block-table row."""
    positions = positions.long()
    return block_table_row.long()[positions // block_size] * block_size + positions % block_size


def kv_token_slots(
    block_table: torch.Tensor, seq_lens_cpu: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots of every cached token of every request, requests one after another, and the
    int32 cumulative sequence lengths [num_reqs + 1], both on the block table's device."""
    device = block_table.device
    seq = seq_lens_cpu.long()
    cu = torch.zeros(seq.numel() + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(seq, 0)
    req = torch.repeat_interleave(torch.arange(seq.numel()), seq)
    pos = torch.arange(int(cu[-1])) - cu[:-1][req]
    # Row r of the flattened table starts at r * width, so position p of request r is flat
    # position r * width * block_size + p.
    flat_pos = (req * block_table.shape[1] * block_size + pos).to(device)
    return slots_of(block_table.reshape(-1), flat_pos, block_size), cu.to(device, torch.int32)


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values stored at ``slots`` (int64 [n]) as they are stored: [n, num_kv_heads,
    head_size] (or packed rows) each, in the cache dtype (a copy, as varlen kernels take contiguous tokens)."""
    kv_heads, head_size = kv_cache.shape[-2], kv_cache.shape[-1]
    k = kv_cache[0].reshape(-1, kv_heads, head_size)[slots]
    v = kv_cache[1].reshape(-1, kv_heads, head_size)[slots]
    return k, v


def read_kv(
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values stored at ``slots`` (any shape), dequantized to ``dtype``.

    Returns two tensors of shape ``slots.shape + (num_kv_heads, head_size)``.
    """
    k, v = gather_kv(kv_cache, slots.reshape(-1).long())
    shape = (*slots.shape, k.shape[1], -1)  # a packed row decodes to fewer or more values
    return (
        dequantize_from_cache(k, k_scale, dtype).view(shape),
        dequantize_from_cache(v, v_scale, dtype).view(shape),
    )


@dataclass(frozen=True)
class VarlenStep:
    """A step in the form varlen attention kernels (``flash_attn_varlen_func`` and its kin) take.

    The new tokens are packed by ``query_start_loc``, each request's keys (cached and new) by
    ``cu_seqlens_k``; ``kv_slots`` are the cache slots of those keys in that order, for backends
    that gather them into contiguous tensors (None when the builder was asked not to keep them).
    """

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    cu_seqlens_k: torch.Tensor  # int32 [num_reqs + 1]
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens], where the new keys/values go
    kv_slots: torch.Tensor | None  # int64 [sum(seq_lens)]

    @classmethod
    def build(
        cls, common: CommonAttentionMetadata, block_size: int, *, gather: bool = True
    ) -> VarlenStep:
        kv_slots, cu_k = kv_token_slots(common.block_table, common.seq_lens_cpu, block_size)
        return cls(
            num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            query_start_loc=common.query_start_loc.int(),
            cu_seqlens_k=cu_k,
            slot_mapping=common.slot_mapping,
            kv_slots=kv_slots if gather else None,
        )
