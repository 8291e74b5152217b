"""``reference``: the pure-torch attention backend that *defines* llmhal's attention semantics.

Every other backend is tested against this one (``llmhal.testing.attention_conformance``), and this
one is tested against ``torch.nn.functional.scaled_dot_product_attention`` on contiguous data. It is
written for clarity, not speed: a Python loop over the requests of a step, float32 math throughout.

Semantics, for a query token at position ``p`` of a request with ``n`` cached tokens before the step:

* it sees key positions ``k <= p`` of its own request (causal), and with a sliding window ``W`` only
  ``p - W < k <= p``;
* scores are ``scale * q.k``; with a soft-cap ``c`` they become ``c * tanh(score / c)``; then softmax;
* GQA/MQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``;
* tree verification (``CommonAttentionMetadata.tree_mask`` of shape [q, q]) applies to every request
  with exactly ``q`` new tokens: new token ``i`` sees every cached key (``k < n``) and the new token
  ``j`` iff ``tree_mask[i, j]``. A sliding window is not defined together with a tree mask (error);
* a query that sees no key at all outputs zeros;
* keys and values are written to the paged cache first (``slot_mapping``, -1 = padding), then read
  back from it, so fp8 caches (see :mod:`llmhal.attention.paged_kv`) affect the new tokens too.

The output has the query's dtype; rows beyond ``num_actual_tokens`` (padding) are zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmhal.attention import paged_kv
from llmhal.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerState,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from llmhal.attention.utils import check_causal


@dataclass(frozen=True)
class ReferenceMetadata:
    """The step description plus host-side copies the per-request loop reads."""

    common: CommonAttentionMetadata
    query_start: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_computed: tuple[int, ...]


class ReferenceMetadataBuilder(AttentionMetadataBuilder[ReferenceMetadata]):
    def build(self, common: CommonAttentionMetadata) -> ReferenceMetadata:
        check_causal(common, "reference attention")
        return ReferenceMetadata(
            common=common,
            query_start=tuple(int(x) for x in common.query_start_loc_cpu),
            seq_lens=tuple(int(x) for x in common.seq_lens_cpu),
            num_computed=tuple(int(x) for x in common.num_computed_tokens_cpu),
        )


def visibility_mask(
    query_positions: torch.Tensor,
    seq_len: int,
    num_computed: int,
    sliding_window: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool [q, seq_len]: may the query at ``query_positions[i]`` see key position ``k``.

    ``tree_mask`` (bool [q, q]) replaces the causal rule among the new tokens (positions
    ``num_computed..``); cached keys stay visible.
    """
    qpos = query_positions.long()[:, None]
    if tree_mask is not None:
        if sliding_window:
            raise ValueError("a sliding window together with a tree mask is not defined")
        q = qpos.shape[0]
        if tree_mask.shape != (q, q) or seq_len != num_computed + q:
            raise ValueError(
                f"tree_mask of shape {tuple(tree_mask.shape)} does not fit a request with {q} "
                f"new tokens after {num_computed} cached ones"
            )
        mask = torch.ones(q, seq_len, dtype=torch.bool, device=qpos.device)
        mask[:, num_computed:] = tree_mask.bool()
        return mask
    return causal_window_mask(
        qpos, torch.arange(seq_len, device=qpos.device)[None, :], sliding_window
    )


def causal_window_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """bool, the two position tensors broadcast: may a query at ``p`` see the key at ``k``.

    Causal (``k <= p``), and with a sliding window ``W`` also ``p - W < k``.
    """
    mask = key_positions <= query_positions
    if sliding_window:
        mask &= key_positions > query_positions - sliding_window
    return mask


def first_visible_position(query_position: int, sliding_window: int | None) -> int:
    """The first key position a query at ``query_position`` sees: with a sliding window ``W``,
    ``query_position - W + 1`` (not below 0); without one, 0. Keys before it can be skipped."""
    return max(0, query_position - sliding_window + 1) if sliding_window else 0


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Masked attention in float32 for one request.

    ``query`` [q, H, D], ``key``/``value`` [k, Hkv, D], ``mask`` bool [q, k]. Returns float32
    [q, H, D]; rows whose mask is all False are zero.
    """
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_heads // num_kv_heads
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    if logits_soft_cap:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # all -inf rows give NaN: they see nothing
    return torch.einsum("hqk,khd->qhd", probs, v)


class ReferenceAttentionImpl(AttentionImpl[ReferenceMetadata]):
    def forward(
        self,
        layer: AttentionLayerState,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: ReferenceMetadata,
    ) -> torch.Tensor:
        m = attn_metadata
        common = m.common
        out = paged_kv.store_and_allocate(layer, query, key, value, kv_cache, common.slot_mapping)
        block_size = kv_cache.shape[2]
        tree = common.tree_mask
        for r in range(common.num_reqs):
            start, end = m.query_start[r], m.query_start[r + 1]
            if start == end:
                continue
            seq_len = m.seq_lens[r]
            slots = paged_kv.slots_of(
                common.block_table[r], torch.arange(seq_len, device=query.device), block_size
            )
            k, v = paged_kv.read_kv(kv_cache, slots, layer.k_scale, layer.v_scale)
            use_tree = tree is not None and tree.shape[0] == end - start
            mask = visibility_mask(
                common.positions[start:end],
                seq_len,
                m.num_computed[r],
                self.sliding_window,
                tree if use_tree else None,
            )
            out[start:end] = attend(
                query[start:end], k, v, mask, self.scale, self.logits_soft_cap
            ).to(query.dtype)
        return out


class ReferenceAttentionBackend(paged_kv.SharedKVLayout, AttentionBackend):
    """Pure-torch paged attention that defines the semantics (see the module docstring)."""

    name = "reference"
    kind = "mha"
    supported_dtypes = ("float32", "bfloat16", "float16")
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2", "int8", "nvfp4")
    supports_sliding_window = True
    supports_logits_soft_cap = True

    @staticmethod
    def get_impl_cls() -> type[ReferenceAttentionImpl]:
        return ReferenceAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[ReferenceMetadataBuilder]:
        return ReferenceMetadataBuilder
