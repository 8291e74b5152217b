"""``reference_mla``: pure-torch MLA that defines the semantics the other MLA backends must match.

A loop over the requests of a step, float32 throughout, written for clarity. Decode requests (one
new token) use the absorbed form and prefills the decompressed one, as every MLA backend does (see
:mod:`llmhal.attention.mla.common` for why); the two forms are equal, and the tests check that too.
Draft-tree verification (``tree_mask``) is honoured like the ``reference`` backend does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmhal.attention import paged_kv
from llmhal.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata
from llmhal.attention.mla.common import (
    MLAAttention,
    MLABackend,
    MLAImpl,
    decompress,
    latent_query,
    read_latent,
    unabsorb_output,
    write_latent,
)
from llmhal.attention.reference import attend, visibility_mask
from llmhal.attention.utils import check_causal


@dataclass(frozen=True)
class ReferenceMLAMetadata:
    """The step plus host copies of its sizes, and each request's cache slots."""

    common: CommonAttentionMetadata
    query_start: tuple[int, ...]
    num_computed: tuple[int, ...]
    # Per request, the slots of its whole sequence (derived here: a recorded step would not see
    # new ones, so a decode graph is refused for this backend, as it must be).
    slots: tuple[torch.Tensor, ...]


class ReferenceMLAMetadataBuilder(AttentionMetadataBuilder[ReferenceMLAMetadata]):
    def build(self, common: CommonAttentionMetadata) -> ReferenceMLAMetadata:
        check_causal(common, "reference_mla attention")
        bs = self.requirements.block_size
        seq_lens = [int(x) for x in common.seq_lens_cpu]
        return ReferenceMLAMetadata(
            common=common,
            query_start=tuple(int(x) for x in common.query_start_loc_cpu),
            num_computed=tuple(int(x) for x in common.num_computed_tokens_cpu),
            slots=tuple(
                paged_kv.slots_of(common.block_table[r], torch.arange(n, device=self.device), bs)
                for r, n in enumerate(seq_lens)
            ),
        )


def absorbed_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    mask: torch.Tensor,
    layer: MLAAttention,
    scale: float,
) -> torch.Tensor:
    """One request's attention in the absorbed form, float32: ``q`` [t, H, nope + rope], cached
    ``latent`` [S, L + R], ``mask`` bool [t, S] -> [t, H, v]."""
    d = layer.dims
    w_uk, w_uv = layer.mla_weights(torch.float32, q.device)
    q_lat = latent_query(q.float(), d, w_uk)  # [t, H, L + R]
    scores = torch.einsum("thl,sl->hts", q_lat, latent) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    o_lat = torch.einsum("hts,sl->thl", probs, latent[:, : d.kv_lora_rank])
    return unabsorb_output(o_lat, w_uv)


def decompressed_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    mask: torch.Tensor,
    layer: MLAAttention,
    scale: float,
) -> torch.Tensor:
    """The same attention with keys and values expanded per head (float32, [t, H, v])."""
    w_uk, w_uv = layer.mla_weights(torch.float32, q.device)
    k, v = decompress(latent, layer.dims, w_uk, w_uv)
    return attend(q.float(), k, v, mask, scale)


class ReferenceMLAImpl(MLAImpl):
    def forward(  # type: ignore[override]
        self,
        layer: MLAAttention,
        query: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: ReferenceMLAMetadata,
    ) -> torch.Tensor:
        m = attn_metadata
        common = m.common
        d = layer.dims
        write_latent(kv_cache, kv_c, k_pe, common.slot_mapping, layer.k_scale)
        out = query.new_zeros(query.shape[0], d.num_heads, d.v_head_dim)
        tree = common.tree_mask
        for r in range(common.num_reqs):
            start, end = m.query_start[r], m.query_start[r + 1]
            if start == end:
                continue
            slots = m.slots[r]
            latent = read_latent(kv_cache, slots, layer.k_scale, torch.float32)
            use_tree = tree is not None and tree.shape[0] == end - start
            mask = visibility_mask(
                common.positions[start:end],
                slots.shape[0],
                m.num_computed[r],
                None,
                tree if use_tree else None,
            )
            form = absorbed_attention if r < common.num_decodes else decompressed_attention
            out[start:end] = form(query[start:end], latent, mask, layer, self.scale).to(out.dtype)
        return out


class ReferenceMLABackend(MLABackend):
    """Pure-torch MLA over the latent cache (see the module docstring)."""

    name = "reference_mla"

    @staticmethod
    def get_impl_cls() -> type[ReferenceMLAImpl]:
        return ReferenceMLAImpl

    @staticmethod
    def get_builder_cls() -> type[ReferenceMLAMetadataBuilder]:
        return ReferenceMLAMetadataBuilder
