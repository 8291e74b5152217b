"""``torch_mla``: MLA in plain torch ops, batched, in the model dtype (the CPU's MLA backend).

Decodes are the common case and run together: the cached latents of every decode request are
gathered into one padded [B, S_max, L + R] tensor and attended in the absorbed form with three
batched matmuls (scores over the latent, the latent-space output, ``W_UV``), so a step's decode cost
does not grow with a Python loop over requests. Prefills (few per step, long) expand their latents
and run ``scaled_dot_product_attention``, which brings torch's fused CPU kernels. Softmax is taken
in float32 whatever the model dtype. Draft-tree steps are refused (``reference_mla`` defines them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
from llmhal.attention.reference import causal_window_mask
from llmhal.attention.utils import check_step


@dataclass(frozen=True)
class PrefillSpan:
    """One prefill (or prefill chunk): its query rows, cache slots and first new position."""

    start: int
    end: int
    slots: torch.Tensor  # int64 [seq_len]
    num_computed: int


@dataclass(frozen=True)
class TorchMLAMetadata:
    common: CommonAttentionMetadata
    num_decodes: int
    decode_slots: torch.Tensor  # int64 [num_decodes, max decode seq_len]; padding repeats slot 0
    decode_valid: torch.Tensor  # bool, same shape: position < seq_len
    prefills: tuple[PrefillSpan, ...]


def decode_gather(
    common: CommonAttentionMetadata, block_size: int, device: torch.device, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decodes' cache slots [num_decodes, width] (padding repeats position 0's slot, a real,
    written one) and which of them are real (position < seq_len); ``width`` defaults to the longest
    decode."""
    seq = common.seq_lens_cpu.long()
    nd = common.num_decodes
    if width is None:
        width = int(seq[:nd].max()) if nd else 0
    pos = torch.arange(width, device=device)
    valid = pos[None, :] < seq[:nd, None].to(device)
    padded = torch.where(valid, pos[None, :], 0)
    table = common.block_table[:nd].long()
    return table.gather(1, padded // block_size) * block_size + padded % block_size, valid


def prefill_spans(
    common: CommonAttentionMetadata,
    block_size: int,
    device: torch.device,
    first: int | None = None,
) -> tuple[PrefillSpan, ...]:
    """The step's prefills and prefill chunks: the requests from ``first`` on (default: those
    after the decodes)."""
    seq = common.seq_lens_cpu.long()
    qsl = [int(x) for x in common.query_start_loc_cpu]
    return tuple(
        PrefillSpan(
            qsl[r],
            qsl[r + 1],
            paged_kv.slots_of(
                common.block_table[r], torch.arange(int(seq[r]), device=device), block_size
            ),
            int(common.num_computed_tokens_cpu[r]),
        )
        for r in range(common.num_decodes if first is None else first, common.num_reqs)
        if qsl[r + 1] > qsl[r]
    )


class TorchMLAMetadataBuilder(AttentionMetadataBuilder[TorchMLAMetadata]):
    # Whether decodes read a gathered [B, S_max] slot table (a kernel reading the block table
    # itself sets this False and gets an empty one).
    gathers_decodes = True

    def build(self, common: CommonAttentionMetadata) -> TorchMLAMetadata:
        check_step(common, "torch_mla attention")
        bs = self.requirements.block_size
        width = None if self.gathers_decodes else 0
        decode_slots, valid = decode_gather(common, bs, self.device, width)
        prefills = prefill_spans(common, bs, self.device)
        return TorchMLAMetadata(common, common.num_decodes, decode_slots, valid, prefills)


class TorchMLAImpl(MLAImpl):
    def forward(  # type: ignore[override]
        self,
        layer: MLAAttention,
        query: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TorchMLAMetadata,
    ) -> torch.Tensor:
        m = attn_metadata
        d = layer.dims
        write_latent(kv_cache, kv_c, k_pe, m.common.slot_mapping, layer.k_scale)
        out = query.new_zeros(query.shape[0], d.num_heads, d.v_head_dim)
        w_uk, w_uv = layer.mla_weights(query.dtype, query.device)
        if m.num_decodes:
            out[: m.num_decodes] = self._decode(
                layer, query[: m.num_decodes], kv_cache, m, w_uk, w_uv
            )
        self._prefills(layer, query, kv_cache, m.common, m.prefills, w_uk, w_uv, out)
        return out

    def _prefills(
        self,
        layer: MLAAttention,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        common: CommonAttentionMetadata,
        prefills: tuple[PrefillSpan, ...],
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Each prefill's rows of ``out``, in the decompressed form (its latents are cached)."""
        d = layer.dims
        for p in prefills:
            latent = read_latent(kv_cache, p.slots, layer.k_scale, query.dtype)
            k, v = decompress(latent, d, w_uk, w_uv)
            q = query[p.start : p.end]
            if p.num_computed == 0:
                mask, causal = None, True
            else:
                qpos = common.positions[p.start : p.end, None]
                mask = causal_window_mask(
                    qpos, torch.arange(k.shape[0], device=q.device)[None, :], None
                )
                causal = False
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                attn_mask=mask, is_causal=causal, scale=self.scale,
            )  # fmt: skip
            out[p.start : p.end] = o.transpose(0, 1)

    def _decode(
        self,
        layer: MLAAttention,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        m: TorchMLAMetadata,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        d = layer.dims
        q_lat = latent_query(q, d, w_uk)  # [B, H, L + R]
        latent = read_latent(kv_cache, m.decode_slots, layer.k_scale, q.dtype)  # [B, S, L + R]
        scores = torch.bmm(q_lat, latent.transpose(1, 2)).float() * self.scale  # [B, H, S]
        scores = scores.masked_fill(~m.decode_valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        o_lat = torch.bmm(probs, latent[..., : d.kv_lora_rank])  # [B, H, L]
        return unabsorb_output(o_lat, w_uv)


class TorchMLABackend(MLABackend):
    """Batched MLA in torch ops over the latent cache (see the module docstring)."""

    name = "torch_mla"

    @staticmethod
    def get_impl_cls() -> type[TorchMLAImpl]:
        return TorchMLAImpl

    @staticmethod
    def get_builder_cls() -> type[TorchMLAMetadataBuilder]:
        return TorchMLAMetadataBuilder
