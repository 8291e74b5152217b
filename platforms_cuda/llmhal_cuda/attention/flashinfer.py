"""``flashinfer``: FlashInfer's paged prefill and decode kernels over the shared paged KV cache.

A step's decodes (the leading requests, one new token each) run through
``BatchDecodeWithPagedKVCacheWrapper``; the prefills and prefill chunks after them through
``BatchPrefillWithPagedKVCacheWrapper`` with a causal mask (FlashInfer aligns it bottom-right, so a
chunk continuing a cached context sees the whole context). Both read ``kv_cache[0]``/``kv_cache[1]``
as ``NHD`` pages.

Planning: FlashInfer splits work in ``plan()`` from the step's page tables, once per step, and the
plan also fixes the softmax scale, sliding window and soft-cap. The builder computes the page tables
once per step; the first layer with a given (scale, window, soft-cap) plans its wrappers, and every
later layer with the same parameters reuses that plan (models that alternate window sizes get one
plan per distinct value). fp8 KV caches pass the layer's ``k_scale``/``v_scale`` to the kernels.
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
)
from llmhal.attention.paged_kv import SharedKVLayout, store_and_allocate
from llmhal.attention.utils import check_step, flash_window_size
from llmhal.utils.imports import require
from llmhal_cuda.attention.common import platform_reasons as _platform_reasons
from llmhal_cuda.libraries import flashinfer_reason

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from llmhal.platforms import Platform

MODULE = "flashinfer"
EXTRA = "flashinfer"
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace
# Above this query/KV head ratio the decode kernels without tensor cores are slower (and only
# small group sizes are compiled for them).
TENSOR_CORE_GQA_RATIO = 4

PlanKey = tuple[float, int, float]  # (sm_scale, window_left, logits_soft_cap)


def _flashinfer() -> Any:
    return require(MODULE, package=f"llmhal-cuda[{EXTRA}]", purpose="the flashinfer backend")


class FlashInferMetadata:
    """One step's page tables, split into the decode part and the prefill part, plus the plans
    made for it so far (keyed by the layer parameters that a plan fixes)."""

    def __init__(
        self,
        builder: FlashInferMetadataBuilder,
        common: CommonAttentionMetadata,
    ) -> None:
        import torch

        self.builder = builder
        self.num_actual_tokens = common.num_actual_tokens
        self.num_decodes = common.num_decodes
        self.num_decode_tokens = common.num_decode_tokens
        self.num_prefills = common.num_prefills
        self.slot_mapping = common.slot_mapping
        bs = builder.block_size
        seq = common.seq_lens_cpu.long()
        pages = (seq + bs - 1) // bs
        self.page_indptr = torch.zeros(seq.numel() + 1, dtype=torch.int32)
        self.page_indptr[1:] = torch.cumsum(pages, 0)
        self.last_page_len = (seq - (pages - 1) * bs).int()
        width = common.block_table.shape[1]
        used = torch.arange(width)[None, :] < pages[:, None]
        self.page_indices = common.block_table[used.to(common.block_table.device)].int()
        # Prefill query offsets are relative to the first prefill token.
        qsl = common.query_start_loc_cpu
        self.prefill_qo_indptr = (qsl[self.num_decodes :] - qsl[self.num_decodes]).int()
        self._plans: dict[PlanKey, tuple[Any, Any]] = {}

    def _part(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(page indptr rebased to 0, page indices, last page lengths) of requests lo..hi-1."""
        indptr = self.page_indptr[lo : hi + 1]
        start, end = int(indptr[0]), int(indptr[-1])
        dev = self.page_indices.device
        return (
            (indptr - start).to(dev),
            self.page_indices[start:end],
            self.last_page_len[lo:hi].to(dev),
        )

    def wrappers(self, key: PlanKey, dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[Any, Any]:
        """(decode wrapper or None, prefill wrapper or None), planned for ``key`` in this step."""
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        b = self.builder
        sm_scale, window_left, cap = key
        decode = prefill = None
        kw: dict[str, Any] = {
            "pos_encoding_mode": "NONE",
            "window_left": window_left,
            "logits_soft_cap": cap or None,
            "sm_scale": sm_scale,
            "q_data_type": dtype,
            "kv_data_type": kv_dtype,
        }
        heads = (b.num_heads, b.num_kv_heads, b.head_size, b.block_size)
        if self.num_decodes:
            decode = b.wrapper("decode", key)
            decode.plan(*self._part(0, self.num_decodes), *heads, **kw)
        if self.num_prefills:
            prefill = b.wrapper("prefill", key)
            indptr, indices, last = self._part(
                self.num_decodes, self.num_decodes + self.num_prefills
            )
            qo = self.prefill_qo_indptr.to(indices.device)
            prefill.plan(qo, indptr, indices, last, *heads, causal=True, **kw)
        self._plans[key] = (decode, prefill)
        return decode, prefill


class FlashInferMetadataBuilder(AttentionMetadataBuilder[FlashInferMetadata]):
    """Owns the workspace and the wrappers (reused across steps, re-planned every step)."""

    def __init__(self, requirements: AttentionRequirements, device: torch.device) -> None:
        super().__init__(requirements, device)
        self.num_heads = requirements.num_heads
        self.num_kv_heads = requirements.num_kv_heads
        self.head_size = requirements.head_size
        self.block_size = requirements.block_size
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[tuple[str, PlanKey], Any] = {}

    def wrapper(self, kind: str, key: PlanKey) -> Any:
        w = self._wrappers.get((kind, key))
        if w is not None:
            return w
        import torch

        fi = _flashinfer()
        if self._workspace is None:
            # FlashInfer requires the float workspace to be zeroed before its first use.
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        if kind == "decode":
            tensor_cores = self.num_heads // self.num_kv_heads > TENSOR_CORE_GQA_RATIO
            w = fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=tensor_cores
            )
        else:
            w = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._wrappers[(kind, key)] = w
        return w

    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        check_step(common, FlashInferBackend.name)
        return FlashInferMetadata(self, common)


class FlashInferImpl(AttentionImpl[FlashInferMetadata]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plan_key: PlanKey = (
            float(self.scale),
            flash_window_size(self.sliding_window)[0],
            float(self.logits_soft_cap or 0.0),
        )
        self._kv_scales: tuple[Any, dict[str, float]] | None = None

    def kv_scales(self, layer: AttentionLayerState) -> dict[str, float]:
        """The layer's fp8 scales as Python floats, read from the device once (FlashInfer takes
        floats; ``float(tensor)`` at every step would synchronise the GPU once per layer). Read
        again only when the tensors are replaced or written in place (their version changes)."""
        key = tuple((id(t), t._version) for t in (layer.k_scale, layer.v_scale))
        if self._kv_scales is None or self._kv_scales[0] != key:
            self._kv_scales = (
                key,
                {"k_scale": float(layer.k_scale), "v_scale": float(layer.v_scale)},
            )
        return self._kv_scales[1]

    def forward(
        self,
        layer: AttentionLayerState,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashInferMetadata,
    ) -> torch.Tensor:
        m = attn_metadata
        n = m.num_actual_tokens
        out = store_and_allocate(layer, query, key, value, kv_cache, m.slot_mapping)
        if n == 0:
            return out
        pages = (kv_cache[0], kv_cache[1])
        # fp8: stored values are multiplied by the scales.
        scales = self.kv_scales(layer) if self.kv_cache_dtype != "auto" else {}
        decode, prefill = m.wrappers(self.plan_key, query.dtype, kv_cache.dtype)
        d = m.num_decode_tokens
        if decode is not None:
            out[:d] = decode.run(query[:d].contiguous(), pages, **scales)
        if prefill is not None:
            out[d:n] = prefill.run(query[d:n].contiguous(), pages, **scales)
        return out


class FlashInferBackend(SharedKVLayout, AttentionBackend):
    name: ClassVar[str] = "flashinfer"
    supported_dtypes = ("float16", "bfloat16")
    supported_head_sizes = (64, 128, 256)
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")
    supports_sliding_window = True
    supports_logits_soft_cap = True
    min_device_capability = (7, 5)

    @staticmethod
    def get_impl_cls() -> type[FlashInferImpl]:
        return FlashInferImpl

    @staticmethod
    def get_builder_cls() -> type[FlashInferMetadataBuilder]:
        return FlashInferMetadataBuilder

    @classmethod
    def availability(cls, platform: Platform) -> list[str]:
        reasons = _platform_reasons(platform)
        missing = flashinfer_reason()
        return reasons if missing is None else [*reasons, missing]
