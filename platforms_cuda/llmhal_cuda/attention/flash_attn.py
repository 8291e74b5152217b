"""``flash_attn``: FlashAttention 2/3 over the shared paged KV cache.

Which FlashAttention runs is decided by what is installed and the device:

* **FA3** (``flash_attn_interface``, the ``hopper/`` build of flash-attention) on compute capability
  9.x: ``flash_attn_with_kvcache`` with ``page_table`` reads the paged cache directly, any block size.
* **FA2** (``flash_attn``) otherwise, on 8.0+. Its paged path (``flash_attn_varlen_func(...,
  block_table=...)``) requires the page size to be a multiple of 256, so with such block sizes the
  kernel reads the pages directly; with smaller blocks (the default 16) the step's keys and values are
  first gathered into contiguous varlen tensors (one extra copy of the attended KV per layer).

Semantics (see ``llmhal.attention.backend``): FlashAttention's causal mask is aligned bottom-right,
which is what a chunk continuing a cached context needs; a sliding window ``W`` is
``window_size=(W - 1, 0)``; a soft-cap ``c`` is ``softcap=c``. fp16/bf16 only, head sizes that are
multiples of 8 up to 256, KV cache in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
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
from llmhal.utils.imports import is_available, require
from llmhal_cuda.attention.common import platform_reasons as _platform_reasons
from llmhal_cuda.libraries import flash_attn2_reason, flash_attn3_reason

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from llmhal.platforms import Platform

FA2_MODULE = "flash_attn"
FA3_MODULE = "flash_attn_interface"
EXTRA = "flash-attn"
FA2_PAGE_MULTIPLE = 256  # flash-attn 2's paged kernels need page sizes divisible by 256
MAX_HEAD_SIZE = 256


def flash_attn_version(capability: tuple[int, int] | None) -> int | None:
    """3 when FA3's API is importable and the device is Hopper (9.x), else 2 when FA2's is, else
    None (see :mod:`llmhal_cuda.libraries` for why an import name alone is not enough)."""
    if capability is not None and capability[0] == 9 and flash_attn3_reason() is None:
        return 3
    if flash_attn2_reason() is None:
        return 2
    return None


@dataclass(frozen=True)
class FlashAttnMetadata:
    """One step, in the form FlashAttention's varlen/paged entry points take (``step.kv_slots``:
    FA2 with small blocks gathers the keys/values at these slots; None otherwise)."""

    version: int
    step: VarlenStep
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]


class FlashAttnMetadataBuilder(AttentionMetadataBuilder[FlashAttnMetadata]):
    def __init__(self, requirements: AttentionRequirements, device: torch.device) -> None:
        super().__init__(requirements, device)
        cap = requirements.device_capability
        if cap is None and device.type == "cuda":
            import torch

            cap = tuple(torch.cuda.get_device_capability(device))
        version = flash_attn_version(cap)
        if version is None:
            raise RuntimeError(f"The flash_attn backend was built but {flash_attn2_reason()}")
        self.version = version
        self.block_size = requirements.block_size
        self.gather = version == 2 and requirements.block_size % FA2_PAGE_MULTIPLE != 0

    def build(self, common: CommonAttentionMetadata) -> FlashAttnMetadata:
        check_step(common, FlashAttentionBackend.name)
        return FlashAttnMetadata(
            version=self.version,
            step=VarlenStep.build(common, self.block_size, gather=self.gather),
            seq_lens=common.seq_lens.int(),
            block_table=common.block_table.int().contiguous(),
        )


class FlashAttentionImpl(AttentionImpl[FlashAttnMetadata]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        require_model_dtype_cache(
            self.kv_cache_dtype,
            FlashAttentionBackend.name,
            "another backend (flashinfer supports fp8)",
        )
        self.window_size = flash_window_size(self.sliding_window)
        self.softcap = float(self.logits_soft_cap or 0.0)

    def forward(
        self,
        layer: AttentionLayerState,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttnMetadata,
    ) -> torch.Tensor:
        m, s = attn_metadata, attn_metadata.step
        n = s.num_actual_tokens
        out = store_and_allocate(layer, query, key, value, kv_cache, s.slot_mapping)
        if n == 0:
            return out
        k_pages, v_pages = kv_cache[0], kv_cache[1]
        common: dict[str, Any] = {
            "softmax_scale": self.scale,
            "causal": True,
            "window_size": self.window_size,
            "softcap": self.softcap,
        }
        if m.version == 3:
            fa3 = require(FA3_MODULE, package=f"llmhal-cuda[{EXTRA}]", purpose="FlashAttention 3")
            result = fa3.flash_attn_with_kvcache(
                query[:n],
                k_pages,
                v_pages,
                cache_seqlens=m.seq_lens,
                page_table=m.block_table,
                cu_seqlens_q=s.query_start_loc,
                max_seqlen_q=s.max_query_len,
                **common,
            )
        else:
            fa2 = require(FA2_MODULE, package=f"llmhal-cuda[{EXTRA}]", purpose="FlashAttention 2")
            if s.kv_slots is not None:
                k, v = gather_kv(kv_cache, s.kv_slots)
                paged: dict[str, Any] = {}
            else:
                k, v, paged = k_pages, v_pages, {"block_table": m.block_table}
            result = fa2.flash_attn_varlen_func(
                query[:n],
                k,
                v,
                s.query_start_loc,
                s.cu_seqlens_k,
                s.max_query_len,
                s.max_seq_len,
                **common,
                **paged,
            )
        out[:n] = result[0] if isinstance(result, tuple) else result
        return out


class FlashAttentionBackend(SharedKVLayout, AttentionBackend):
    name: ClassVar[str] = "flash_attn"
    supported_dtypes = ("float16", "bfloat16")
    supported_block_sizes = (MultipleOf(16),)
    supported_kv_cache_dtypes = ("auto",)
    supports_sliding_window = True
    supports_logits_soft_cap = True
    min_device_capability = (8, 0)

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return FlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FlashAttnMetadataBuilder]:
        return FlashAttnMetadataBuilder

    @classmethod
    def availability(cls, platform: Platform) -> list[str]:
        reasons = _platform_reasons(platform)
        fa2 = flash_attn2_reason()
        if fa2 is not None:
            fa3 = flash_attn3_reason()
            if fa3 is None:
                return reasons  # FA3 alone: supports_combination checks for Hopper
            # A missing FA3 is worth naming only when something of it is installed.
            reasons += [fa2] if not is_available(FA3_MODULE) else [fa2, fa3]
        return reasons

    @classmethod
    def supports_combination(cls, requirements: AttentionRequirements) -> str | None:
        hs = requirements.head_size
        if hs % 8 or hs > MAX_HEAD_SIZE:
            return f"head_size {hs} not supported (multiples of 8 up to {MAX_HEAD_SIZE})"
        cap = requirements.device_capability
        if flash_attn_version(cap) is None and flash_attn3_reason() is None:
            have = ".".join(map(str, cap)) if cap else "unknown"
            return (
                f"only FlashAttention 3 (flash_attn_interface) is installed, which needs compute "
                f"capability 9.x (this device: {have}); {flash_attn2_reason()}"
            )
        return None
