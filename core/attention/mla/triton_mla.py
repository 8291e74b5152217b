"""``triton_mla``: MLA decode in a Triton kernel, prefill as ``torch_mla`` does.

Decodes (the step's leading one-token requests) run the absorbed form: ``q_nope @ W_UK`` in torch,
then :func:`~llmhal.attention.mla.triton_mla_kernel.mla_decode` reads each request's cached latents
straight from the paged cache through its block table (no gathered copy), and ``W_UV`` is applied in
torch. Prefills expand their latents and use ``scaled_dot_product_attention`` (``torch_mla``'s path).
float32 models use IEEE float32 dot products in the kernel (not TF32), so they match the reference.

Availability as ``triton_attn``: the ``triton`` package, and a platform that runs Triton kernels
(``capabilities.triton``) or ``TRITON_INTERPRET=1`` (the CPU interpreter; tests). It is not in any
priority list yet (choose it with ``VLLM_ATTENTION_BACKEND=triton_mla``): only the interpreter has
run it so far; a platform that has run it on its devices may rank it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from llmhal.attention.mla.common import MLAAttention, MLABackend, latent_query, unabsorb_output
from llmhal.attention.mla.torch_mla import TorchMLAImpl, TorchMLAMetadata, TorchMLAMetadataBuilder
from llmhal.utils.imports import require

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.platforms import Platform


class TritonMLAMetadataBuilder(TorchMLAMetadataBuilder):
    gathers_decodes = False


class TritonMLAImpl(TorchMLAImpl):
    def _decode(
        self,
        layer: MLAAttention,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        m: TorchMLAMetadata,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        require("triton", purpose="the triton_mla attention backend")
        from llmhal.attention.mla.triton_mla_kernel import mla_decode

        d, nd = layer.dims, m.num_decodes
        q_lat = latent_query(q, d, w_uk)
        o_lat = mla_decode(
            q_lat, kv_cache, m.common.block_table[:nd], m.common.seq_lens[:nd], layer.k_scale,
            self.scale, d.kv_lora_rank, ieee=q.dtype == torch.float32,
        )  # fmt: skip
        return unabsorb_output(o_lat.to(q.dtype), w_uv)


class TritonMLABackend(MLABackend):
    """Triton MLA decode over the latent cache (see the module docstring)."""

    name = "triton_mla"
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "fp8_e4m3", "fp8_e5m2")

    @classmethod
    def availability(cls, platform: Platform) -> list[str]:
        from llmhal.attention.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend.availability(platform)

    @staticmethod
    def get_impl_cls() -> type[TritonMLAImpl]:
        return TritonMLAImpl

    @staticmethod
    def get_builder_cls() -> type[TritonMLAMetadataBuilder]:
        return TritonMLAMetadataBuilder
