"""``rocm_attn``: Triton attention for AMD GPUs, with a dedicated split-KV decode path.

A step is split where the contract already splits it (decodes first):

* **decodes** (one new token per request) run :func:`llmhal_rocm.attention.paged_decode.paged_decode`,
  which cuts each request's KV history into splits so that small decode batches with long contexts
  still fill the GPU's compute units, then merges the splits;
* **prefills and prefill chunks** run core's ``triton_attn`` backend (its builder and implementation,
  through the attention contract) on the prefill part of the step, so the prefill kernel is core's and
  is not copied here.

Both read core's shared paged layout, so one KV cache serves both paths. fp8 caches are supported
where core's prefill path supports them (the decode kernel dequantizes with the layer's scales).
Runs wherever Triton runs on the device (``capabilities.triton``), or in Triton's interpreter with
``TRITON_INTERPRET=1`` (CPU tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
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
from llmhal.attention.registry import CORE_BACKENDS
from llmhal.attention.utils import check_step
from llmhal.utils.imports import is_available, resolve_obj_by_qualname
from llmhal_rocm.attention.common import not_installed, rocm_platform

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from llmhal.platforms import Platform

PREFILL_BACKEND = "triton_attn"


def prefill_backend() -> type[AttentionBackend]:
    """Core's Triton backend, which serves the prefill part of every step."""
    return resolve_obj_by_qualname(CORE_BACKENDS[PREFILL_BACKEND][0])


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _sub_step(common: CommonAttentionMetadata, lo: int, hi: int) -> CommonAttentionMetadata:
    """Requests ``lo..hi-1`` of a step as a step of their own (token offsets rebased to 0)."""
    qsl = common.query_start_loc_cpu
    t0, t1 = int(qsl[lo]), int(qsl[hi])
    seq = common.seq_lens_cpu[lo:hi]
    q = qsl[lo + 1 : hi + 1] - qsl[lo:hi]
    num_decodes = min(max(common.num_decodes - lo, 0), hi - lo)
    return replace(
        common,
        query_start_loc=common.query_start_loc[lo : hi + 1] - t0,
        query_start_loc_cpu=qsl[lo : hi + 1] - t0,
        seq_lens=common.seq_lens[lo:hi],
        seq_lens_cpu=seq,
        num_computed_tokens_cpu=common.num_computed_tokens_cpu[lo:hi],
        block_table=common.block_table[lo:hi],
        slot_mapping=common.slot_mapping[t0:t1],
        positions=common.positions[t0:t1],
        num_reqs=hi - lo,
        num_actual_tokens=t1 - t0,
        max_query_len=int(q.max()) if hi > lo else 0,
        max_seq_len=int(seq.max()) if hi > lo else 0,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
    )


@dataclass(frozen=True)
class RocmAttnMetadata:
    num_actual_tokens: int
    num_decodes: int
    slot_mapping: torch.Tensor
    decode_block_table: torch.Tensor  # int32 [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor  # int32 [num_decodes]
    decode_max_seq_len: int
    prefill: Any  # core triton_attn metadata of the prefill part, or None


class RocmAttnMetadataBuilder(AttentionMetadataBuilder[RocmAttnMetadata]):
    def __init__(self, requirements: AttentionRequirements, device: torch.device) -> None:
        super().__init__(requirements, device)
        self.prefill_builder = prefill_backend().get_builder_cls()(requirements, device)

    def build(self, common: CommonAttentionMetadata) -> RocmAttnMetadata:
        check_step(common, RocmAttentionBackend.name)
        d = common.num_decodes
        prefill = None
        if common.num_reqs > d:
            prefill = self.prefill_builder.build(_sub_step(common, d, common.num_reqs))
        return RocmAttnMetadata(
            num_actual_tokens=common.num_actual_tokens,
            num_decodes=d,
            slot_mapping=common.slot_mapping,
            decode_block_table=common.block_table[:d].int(),
            decode_seq_lens=common.seq_lens[:d].int(),
            decode_max_seq_len=int(common.seq_lens_cpu[:d].max()) if d else 0,
            prefill=prefill,
        )


class RocmAttentionImpl(AttentionImpl[RocmAttnMetadata]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefill_impl = prefill_backend().get_impl_cls()(*args, **kwargs)

    def forward(
        self,
        layer: AttentionLayerState,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: RocmAttnMetadata,
    ) -> torch.Tensor:
        from llmhal_rocm.attention.paged_decode import paged_decode

        m = attn_metadata
        d, n = m.num_decodes, m.num_actual_tokens
        # The decode tokens' keys/values are stored here; the prefill path stores its own.
        out = store_and_allocate(layer, query, key, value, kv_cache, m.slot_mapping[:d])
        if d:
            out[:d] = paged_decode(
                query[:d],
                kv_cache,
                m.decode_block_table,
                m.decode_seq_lens,
                m.decode_max_seq_len,
                self.scale,
                layer.k_scale,
                layer.v_scale,
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
            )
        if m.prefill is not None:
            out[d:n] = self.prefill_impl.forward(
                layer, query[d:n], key[d:n], value[d:n], kv_cache, m.prefill
            )
        return out


class RocmAttentionBackend(SharedKVLayout, AttentionBackend):
    name: ClassVar[str] = "rocm_attn"
    supported_dtypes = ("float16", "bfloat16", "float32")
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")
    supports_sliding_window = True
    supports_logits_soft_cap = True

    @staticmethod
    def get_impl_cls() -> type[RocmAttentionImpl]:
        return RocmAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[RocmAttnMetadataBuilder]:
        return RocmAttnMetadataBuilder

    @classmethod
    def availability(cls, platform: Platform) -> list[str]:
        rocm, reasons = rocm_platform(platform)
        if rocm is None:
            return reasons
        if not is_available("triton"):
            return [not_installed("triton", "triton")]
        if not (rocm.capabilities.triton or _interpreted()):
            archs = rocm.capabilities.extra.get("gcn_arch", "unknown")
            reasons.append(
                f"Triton does not support this GPU ({archs}; it needs CDNA2+ or RDNA3+), and "
                f"TRITON_INTERPRET=1 is not set"
            )
        try:
            prefill = prefill_backend()
        except Exception as e:
            return [
                *reasons,
                f"core's {PREFILL_BACKEND} (the prefill path) cannot be imported: {e}",
            ]
        reasons += [
            f"prefill path ({PREFILL_BACKEND}): {r}" for r in prefill.availability(platform)
        ]
        return reasons

    @classmethod
    def supports_combination(cls, requirements: AttentionRequirements) -> str | None:
        # The prefill path must accept the configuration too (dtype, head size, fp8 cache, ...).
        try:
            prefill = prefill_backend()
        except Exception:
            return None  # reported by availability()
        reasons = prefill.validate(replace(requirements, kind=prefill.kind))
        if reasons:
            return f"prefill path ({PREFILL_BACKEND}): " + "; ".join(reasons)
        return None
