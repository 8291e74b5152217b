"""``cpu_mla``: the CPU platform's MLA backend (DeepSeek-V2/V3 layers).

A step's decodes, and the short query runs that follow them (draft verifications, prompt chunks of
up to :data:`~llmhal_cpu.attention.cpu_attn.KERNEL_MAX_QUERY_LEN` tokens), run in one native call
(:mod:`llmhal_cpu.kernels.mla_decode`): it stores the step's new latents, absorbs the queries
through ``W_UK``, attends causally over the paged latent cache straight through the block table and
applies ``W_UV``. Through ``torch_mla`` the same work was ~15 torch ops a layer; here it is one
kernel call, and one a recorded step can replay.

Recording needs the metadata of such a step to be views of the step's common tensors (the slot
mapping, query start offsets, block table and sequence lengths the decode-graph runner refills),
with nothing derived from their values at build time beyond the query lengths a graph is keyed by:
:class:`CpuMLAMetadataBuilder` builds exactly that, and derives prefill spans (read from the host
copies, as ``torch_mla`` does) only for the longer requests after those. Those prefills take
``torch_mla``'s decompressed path after the kernel has stored their latents.

Where the kernel does not apply (an fp8, int8 or nvfp4 latent cache, float16, no compiler,
``LLMHAL_CPU_MLA_KERNEL=0``) the whole step runs ``torch_mla``'s ops, so those steps are not
recorded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from llmhal.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata
from llmhal.attention.mla.common import MLAAttention, MLABackend
from llmhal.attention.mla.torch_mla import (
    PrefillSpan,
    TorchMLAImpl,
    TorchMLAMetadata,
    decode_gather,
    prefill_spans,
)
from llmhal.attention.utils import check_step
from llmhal_cpu.attention.cpu_attn import KERNEL_MAX_QUERY_LEN
from llmhal_cpu.kernels import mla_decode


@dataclass(frozen=True)
class CpuMLAMetadata:
    """One step's MLA metadata; every tensor a view of ``common``'s (see the module docstring)."""

    common: CommonAttentionMetadata
    block_size: int
    num_kernel_reqs: int  # the leading requests whose rows the kernel attends
    num_kernel_rows: int
    slots: torch.Tensor  # int64 [num_actual_tokens], -1 = not written
    query_start_loc: torch.Tensor  # int32 [num_kernel_reqs + 1]
    block_table: torch.Tensor  # int32 [num_kernel_reqs, width]
    seq_lens: torch.Tensor  # int32 [num_kernel_reqs]
    prefills: tuple[PrefillSpan, ...]  # the requests after those

    @functools.cached_property
    def torch_form(self) -> TorchMLAMetadata:
        """The step as ``torch_mla`` reads it (built only when the kernel does not apply)."""
        c, bs, dev = self.common, self.block_size, self.slots.device
        slots, valid = decode_gather(c, bs, dev)
        return TorchMLAMetadata(c, c.num_decodes, slots, valid, prefill_spans(c, bs, dev))


class CpuMLAMetadataBuilder(AttentionMetadataBuilder[CpuMLAMetadata]):
    def build(self, common: CommonAttentionMetadata) -> CpuMLAMetadata:
        check_step(common, "cpu_mla attention")
        bs = self.requirements.block_size
        # The kernel takes the leading run of short query runs (decodes come first by contract;
        # draft verifications and short prompt chunks follow): memory-bound work, where the
        # absorbed form reads the least. The count is read from the host offsets, as a recorded
        # step's shape is (the decode-graph runner keys its graphs by the query lengths).
        qsl = common.query_start_loc_cpu.tolist()
        n = 0
        while n < common.num_reqs and qsl[n + 1] - qsl[n] <= KERNEL_MAX_QUERY_LEN:
            n += 1
        # .to() and .contiguous() return the tensor itself when it already fits (the engine's
        # int64 slots and int32 tables), so a recorded step's metadata stays views of the
        # runner's static buffers.
        slots = common.slot_mapping[: common.num_actual_tokens].to(torch.int64).contiguous()
        return CpuMLAMetadata(
            common=common,
            block_size=bs,
            num_kernel_reqs=n,
            num_kernel_rows=qsl[n] - qsl[0],
            slots=slots,
            query_start_loc=common.query_start_loc[: n + 1].to(torch.int32).contiguous(),
            block_table=common.block_table[:n].to(torch.int32).contiguous(),
            seq_lens=common.seq_lens[:n].to(torch.int32).contiguous(),
            prefills=prefill_spans(common, bs, self.device, first=n),
        )


class CpuMLAImpl(TorchMLAImpl):
    def forward(  # type: ignore[override]
        self,
        layer: MLAAttention,
        query: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CpuMLAMetadata,
    ) -> torch.Tensor:
        m = attn_metadata
        d = layer.dims
        if not mla_decode.takes(query, kv_c, k_pe, kv_cache):
            return super().forward(layer, query, kv_c, k_pe, kv_cache, m.torch_form)
        w_uk, w_uv = layer.mla_weights(query.dtype, query.device)
        n = query.shape[0]
        # empty, not zeros: a pure decode step's rows are all written by the kernel, and a step
        # that only allocates besides native calls can be recorded.
        out = torch.empty(n, d.num_heads, d.v_head_dim, dtype=query.dtype, device=query.device)
        done = mla_decode.mla_decode(
            d, self.scale, query, kv_c, k_pe, kv_cache, m.slots, m.query_start_loc,
            m.block_table, m.seq_lens, m.num_kernel_reqs, m.num_kernel_rows, w_uk, w_uv, out,
        )  # fmt: skip
        if not done:
            return super().forward(layer, query, kv_c, k_pe, kv_cache, m.torch_form)
        if n > m.num_kernel_rows:  # prefill rows, and padding rows (zero by the MLA contract)
            out[m.num_kernel_rows :].zero_()
            self._prefills(layer, query, kv_cache, m.common, m.prefills, w_uk, w_uv, out)
        return out


class CpuMLABackend(MLABackend):
    """MLA on the CPU: decodes in one native call, prefills as ``torch_mla`` (module docstring)."""

    name = "cpu_mla"

    @staticmethod
    def get_impl_cls() -> type[CpuMLAImpl]:
        return CpuMLAImpl

    @staticmethod
    def get_builder_cls() -> type[CpuMLAMetadataBuilder]:
        return CpuMLAMetadataBuilder
