"""``flashmla``: DeepSeek's FlashMLA decode kernel over the MLA latent cache (Hopper and newer).

Decodes run FlashMLA's absorbed-form kernel: core's ``latent_query`` folds ``W_UK`` into the query
(``[B, H, kv_lora_rank + rope]``), ``flash_mla.flash_mla_with_kvcache`` attends it over the paged
latent cache read through the block table (the cache viewed as ``[blocks, 64, 1, 576]``: FlashMLA's
MQA form, one latent "head"), returning the latent-space output (``head_dim_v`` = kv_lora_rank),
and ``W_UV`` is applied in torch. Its scheduling metadata comes from ``get_mla_metadata`` once per
step (every layer of a step shares it). Prefills (and prefill chunks) take ``torch_mla``'s path:
decompressed keys/values through ``scaled_dot_product_attention``, the compute-bound form.

Constraints (FlashMLA's kernels): 64-token pages (``--block-size 64``), bfloat16/float16 models,
DeepSeek's latent of 512 + 64 values, a KV cache in the model dtype; compute capability 9.x or
10.x. Both generations of its Python API are called the same way: the arguments llmhal passes are
positional in the 2025-02 release and keep those positions in later ones (where
``get_mla_metadata`` ignores its arguments and schedules lazily). ``pip install flash-mla`` (built
from github.com/deepseek-ai/FlashMLA).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from llmhal.attention.backend import AttentionRequirements, CommonAttentionMetadata
from llmhal.attention.mla.common import MLAAttention, MLABackend, latent_query, unabsorb_output
from llmhal.attention.mla.torch_mla import TorchMLAImpl, TorchMLAMetadata, TorchMLAMetadataBuilder
from llmhal.utils.imports import require
from llmhal_cuda.attention.common import platform_reasons
from llmhal_cuda.libraries import flashmla_reason

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.platforms import Platform

MODULE = "flash_mla"
PACKAGE = "flash-mla (build github.com/deepseek-ai/FlashMLA)"
PAGE = 64  # FlashMLA's page_block_size
KV_LORA_RANK, ROPE_DIM = 512, 64  # the latent its kernels are built for (DeepSeek-V2/V3)


@dataclass(frozen=True)
class FlashMLAMetadata(TorchMLAMetadata):
    """torch_mla's step description plus FlashMLA's decode schedule (built once per step, shared
    by every layer): ``cache_seqlens`` int32 [num_decodes], ``block_table`` int32, and what
    ``get_mla_metadata`` returned (``tile_metadata``, ``num_splits``)."""

    cache_seqlens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    tile_metadata: Any = None
    num_splits: Any = None


class FlashMLAMetadataBuilder(TorchMLAMetadataBuilder):
    gathers_decodes = False  # the kernel reads the block table itself

    def build(self, common: CommonAttentionMetadata) -> FlashMLAMetadata:  # type: ignore[override]
        base = super().build(common)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        nd = base.num_decodes
        if not nd:
            return FlashMLAMetadata(**fields)
        flash_mla = require(MODULE, package=PACKAGE, purpose="the flashmla attention backend")
        seq_lens = common.seq_lens[:nd].to(torch.int32)
        # One query token per request and one latent "head": s_q * h_q // h_kv = num_heads.
        tile, splits = flash_mla.get_mla_metadata(seq_lens, self.requirements.num_heads, 1)
        return FlashMLAMetadata(
            **fields,
            cache_seqlens=seq_lens,
            block_table=common.block_table[:nd].to(torch.int32).contiguous(),
            tile_metadata=tile,
            num_splits=splits,
        )


class FlashMLAImpl(TorchMLAImpl):
    def _decode(  # type: ignore[override]
        self,
        layer: MLAAttention,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        m: FlashMLAMetadata,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        flash_mla = require(MODULE, package=PACKAGE, purpose="the flashmla attention backend")
        d = layer.dims
        q_lat = latent_query(q, d, w_uk)  # [B, H, L + R]
        blocks, page, width = kv_cache.shape
        out, _lse = flash_mla.flash_mla_with_kvcache(
            q_lat.unsqueeze(1),  # [B, s_q=1, H, L + R]
            kv_cache.view(blocks, page, 1, width),  # one latent "head"
            m.block_table,
            m.cache_seqlens,
            d.kv_lora_rank,  # head_dim_v: the output stays in the latent space
            m.tile_metadata,
            m.num_splits,
            softmax_scale=self.scale,
            causal=True,
        )
        return unabsorb_output(out.squeeze(1).to(q.dtype), w_uv)


class FlashMLABackend(MLABackend):
    """FlashMLA decode, torch_mla prefill (see the module docstring)."""

    name = "flashmla"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    supported_block_sizes = (PAGE,)
    supported_head_sizes = (KV_LORA_RANK + ROPE_DIM,)
    min_device_capability = (9, 0)

    @classmethod
    def availability(cls, platform: Platform) -> list[str]:
        reason = flashmla_reason()
        return platform_reasons(platform) + ([reason] if reason else [])

    @classmethod
    def supports_combination(cls, requirements: AttentionRequirements) -> str | None:
        base = super().supports_combination(requirements)
        if base is not None:
            return base
        cap = requirements.device_capability
        if cap is not None and cap[0] not in (9, 10):
            return (
                f"FlashMLA's kernels are built for compute capability 9.x and 10.x, not {cap[0]}.x"
            )
        return None

    @staticmethod
    def get_impl_cls() -> type[FlashMLAImpl]:
        return FlashMLAImpl

    @staticmethod
    def get_builder_cls() -> type[FlashMLAMetadataBuilder]:
        return FlashMLAMetadataBuilder
