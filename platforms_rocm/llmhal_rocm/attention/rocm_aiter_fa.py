"""``rocm_aiter_fa``: AMD aiter's Composable-Kernel flash attention (MI300/MI350: gfx942, gfx950).

Every step gathers the attended keys and values of each request from the shared paged cache into
contiguous varlen tensors and calls ``aiter.flash_attn_varlen_func`` once for the whole batch
(decodes and prefill chunks alike; aiter's causal mask is aligned bottom-right, which is what a chunk
continuing a cached context needs). The gather keeps the backend independent of aiter's paged-KV
entry points, whose page-size rules change between releases; it costs one copy of the attended KV
per layer.

Selection: an explicit ``VLLM_ATTENTION_BACKEND=rocm_aiter_fa`` is honoured whenever aiter is
installed and the arch supports it. Automatic selection considers it only with
``VLLM_ROCM_USE_AITER=1``: aiter compiles its kernels on first use (minutes), so it is opt-in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from llmhal.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerState,
    AttentionMetadataBuilder,
    AttentionRequirements,
    CommonAttentionMetadata,
    MultipleOf,
)
from llmhal.attention.paged_kv import SharedKVLayout, VarlenStep, gather_kv, store_and_allocate
from llmhal.attention.utils import check_step, flash_window_size, require_model_dtype_cache
from llmhal.utils.imports import require
from llmhal_rocm.arch import AITER_ARCHS, supports_aiter
from llmhal_rocm.attention.common import rocm_platform
from llmhal_rocm.libraries import aiter_reason

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from llmhal.platforms import Platform

MODULE = "aiter"
EXTRA = "aiter"
MAX_HEAD_SIZE = 256


# Every step gathers the attended keys/values: ``kv_slots`` is always set.
AiterFaMetadata = VarlenStep


class AiterFaMetadataBuilder(AttentionMetadataBuilder[AiterFaMetadata]):
    def build(self, common: CommonAttentionMetadata) -> AiterFaMetadata:
        check_step(common, AiterFlashAttentionBackend.name)
        return VarlenStep.build(common, self.requirements.block_size)


class AiterFlashAttentionImpl(AttentionImpl[AiterFaMetadata]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        require_model_dtype_cache(
            self.kv_cache_dtype, AiterFlashAttentionBackend.name, "the rocm_attn backend"
        )
        self.window_size = flash_window_size(self.sliding_window)

    def forward(
        self,
        layer: AttentionLayerState,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AiterFaMetadata,
    ) -> torch.Tensor:
        m = attn_metadata
        n = m.num_actual_tokens
        out = store_and_allocate(layer, query, key, value, kv_cache, m.slot_mapping)
        if n == 0:
            return out
        aiter = require(MODULE, package=f"llmhal-rocm[{EXTRA}]", purpose="rocm_aiter_fa")
        assert m.kv_slots is not None  # built with gather=True
        k, v = gather_kv(kv_cache, m.kv_slots)
        result = aiter.flash_attn_varlen_func(
            query[:n],
            k,
            v,
            m.query_start_loc,
            m.cu_seqlens_k,
            m.max_query_len,
            m.max_seq_len,
            softmax_scale=self.scale,
            logits_soft_cap=float(self.logits_soft_cap or 0.0),
            causal=True,
            window_size=self.window_size,
        )
        out[:n] = result[0] if isinstance(result, tuple) else result
        return out


class AiterFlashAttentionBackend(SharedKVLayout, AttentionBackend):
    name: ClassVar[str] = "rocm_aiter_fa"
    supported_dtypes = ("float16", "bfloat16")
    supported_block_sizes = (MultipleOf(16),)
    supported_kv_cache_dtypes = ("auto",)
    supports_sliding_window = True
    supports_logits_soft_cap = True

    @staticmethod
    def get_impl_cls() -> type[AiterFlashAttentionImpl]:
        return AiterFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AiterFaMetadataBuilder]:
        return AiterFaMetadataBuilder

    @classmethod
    def availability(cls, platform: Platform) -> list[str]:
        rocm, reasons = rocm_platform(platform)
        if rocm is None:
            return reasons
        missing = aiter_reason()
        if missing is not None:
            reasons.append(missing)
        archs = sorted({d.arch for d in rocm.visible_devices()})
        unsupported = [a for a in archs if not supports_aiter(a)]
        if unsupported:
            reasons.append(
                f"aiter flash attention needs {' or '.join(sorted(AITER_ARCHS))} "
                f"(this device: {', '.join(unsupported)})"
            )
        return reasons

    @classmethod
    def supports_combination(cls, requirements: AttentionRequirements) -> str | None:
        if requirements.head_size > MAX_HEAD_SIZE:
            return f"head_size {requirements.head_size} not supported (at most {MAX_HEAD_SIZE})"
        return None
