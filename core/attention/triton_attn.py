"""``triton_attn``: paged attention in one Triton kernel launch per layer and step.

Prefill chunks and decodes of a varlen batch go through the same kernel
(:func:`llmhal.attention.triton_kernels.unified_attention`), with GQA/MQA, sliding window, soft-cap
and fp8 KV caches. Keys and values are written to the cache first (shared layout and fp8 rule of
:mod:`llmhal.attention.paged_kv`), then the kernel reads them back, new tokens included.

Availability: the ``triton`` package must be importable, and the platform must run Triton kernels
(``capabilities.triton``) or ``TRITON_INTERPRET=1`` must be set, which runs them on the CPU
interpreter (slow; for testing). The kernel module, and with it triton, is imported on first use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmhal.attention import paged_kv
from llmhal.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerState,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from llmhal.attention.utils import check_step
from llmhal.utils.imports import is_available, require

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.platforms import Platform


def _kernels():  # type: ignore[no-untyped-def]
    require("triton", purpose="the triton_attn attention backend")
    from llmhal.attention import triton_kernels

    return triton_kernels


@dataclass(frozen=True)
class TritonMetadata:
    common: CommonAttentionMetadata
    block_q: int
    tile_req: torch.Tensor  # int32 [num_tiles]
    tile_qoff: torch.Tensor  # int32 [num_tiles]
    query_start_loc: torch.Tensor  # int32
    seq_lens: torch.Tensor  # int32
    block_table: torch.Tensor  # int32
    positions: torch.Tensor  # int64


class TritonMetadataBuilder(AttentionMetadataBuilder[TritonMetadata]):
    def build(self, common: CommonAttentionMetadata) -> TritonMetadata:
        check_step(common, TritonAttentionBackend.name)
        k = _kernels()
        r = self.requirements
        block_q = k.block_q_for(r.num_heads // r.num_kv_heads)
        tile_req, tile_qoff = k.plan_query_tiles(common.query_start_loc_cpu, block_q, self.device)
        return TritonMetadata(
            common=common,
            block_q=block_q,
            tile_req=tile_req,
            tile_qoff=tile_qoff,
            query_start_loc=common.query_start_loc.to(torch.int32),
            seq_lens=common.seq_lens.to(torch.int32),
            block_table=common.block_table.to(torch.int32).contiguous(),
            positions=common.positions.to(torch.int64),
        )


class TritonAttentionImpl(AttentionImpl[TritonMetadata]):
    def forward(
        self,
        layer: AttentionLayerState,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonMetadata,
    ) -> torch.Tensor:
        m = attn_metadata
        k = _kernels()
        paged_kv.write_kv(kv_cache, key, value, m.common.slot_mapping, layer.k_scale, layer.v_scale)
        # The interpreter rounds bf16/fp16 stores wrongly: let it write float32, cast here.
        out_dtype = torch.float32 if k.interpreter_active() else query.dtype
        out = torch.zeros(query.shape, dtype=out_dtype, device=query.device)
        k.unified_attention(
            out,
            query,
            kv_cache[0],
            kv_cache[1],
            m.block_table,
            m.query_start_loc,
            m.seq_lens,
            m.positions,
            m.tile_req,
            m.tile_qoff,
            layer.k_scale,
            layer.v_scale,
            self.scale,
            block_q=m.block_q,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )
        return out.to(query.dtype)


class TritonAttentionBackend(paged_kv.SharedKVLayout, AttentionBackend):
    """Unified prefill+decode paged attention in Triton (see the module docstring)."""

    name = "triton_attn"
    kind = "mha"
    supported_dtypes = ("float32", "bfloat16", "float16")
    supported_block_sizes = (MultipleOf(16),)  # tl.dot needs tiles of at least 16
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")
    supports_sliding_window = True
    supports_logits_soft_cap = True

    @classmethod
    def availability(cls, platform: Platform) -> list[str]:
        if not is_available("triton"):
            return ["the triton package is not installed (pip install triton)"]
        if platform.capabilities.triton or os.environ.get("TRITON_INTERPRET") == "1":
            return []
        return [
            f"the {platform.name} platform cannot run Triton kernels (capabilities.triton is "
            "False); set TRITON_INTERPRET=1 to run them in Triton's (slow) CPU interpreter"
        ]

    @staticmethod
    def get_impl_cls() -> type[TritonAttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TritonMetadataBuilder]:
        return TritonMetadataBuilder
