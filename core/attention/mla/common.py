"""The MLA contract: the layer, the latent KV cache layout, and the absorbed / decompressed forms.

DeepSeek's attention compresses each token's keys and values into one latent vector ``c`` of
``kv_lora_rank`` values (``kv_a_proj_with_mqa`` then ``kv_a_layernorm``) plus one rotary key ``k_pe``
of ``qk_rope_head_dim`` values shared by every head. Head ``h`` sees

* key ``[W_UK[h] @ c, k_pe]`` and value ``W_UV[h] @ c``, where ``kv_b_proj``'s weight stacks, per
  head, ``W_UK[h]`` [qk_nope_head_dim, kv_lora_rank] then ``W_UV[h]`` [v_head_dim, kv_lora_rank];
* query ``[q_nope, q_pe]`` (``q_pe`` rotated by the model, like ``k_pe``).

**Latent cache layout** (every MLA backend here): one tensor ``[num_blocks, block_size,
kv_lora_rank + qk_rope_head_dim]`` per layer, the token in slot ``s`` at ``view(-1, latent)[s]``:
``c`` then ``k_pe``. There are no per-head keys or values: the engine sees one KV "head" of size
``kv_lora_rank + qk_rope_head_dim`` (DeepSeek-V3: 576 values a token a layer, against 2 x 128 heads x
192 = 49152 for the same attention with its keys and values expanded). With an fp8
``kv_cache_dtype`` the latent is stored scaled by the layer's ``k_scale`` (the shared paged-KV rule,
:mod:`llmhal.attention.paged_kv`); ``int8`` and ``nvfp4`` store it as one packed row of
:mod:`llmhal.attention.kv_formats` (int8: one scale for the token's whole latent).

**Two equal forms of the same attention** (backends use both, as vLLM does):

* *decompressed* (prefill): expand the cached latents of the request into per-head keys and values,
  then attend with head size ``qk_nope + qk_rope`` (192). Many queries share each expanded key, so
  the expansion is paid once per key and the attention itself stays narrow: prefill is compute-bound
  and this is the cheaper one in FLOPs.
* *absorbed* (decode): ``q_nope @ W_UK[h]`` moves the query into latent space, the scores are
  ``q_lat . c + q_pe . k_pe``, the output ``(probs @ c) @ W_UV[h].T``. Each step's cost per cached
  token is one read of the 576-value latent (an MQA with one wide head) instead of expanding every
  cached latent into 128 heads again: decode is bound by memory traffic, and this reads the least.

The model's ``kv_b_proj`` is the one source of ``W_UK``/``W_UV``: :meth:`MLAAttention.mla_weights`
reads them through the layer itself (its output on the identity), so any quantization method of that
linear works, and recomputes them when its weights change.

**Impl contract** (:class:`MLAImpl`): ``forward(layer, q, kv_c, k_pe, kv_cache, metadata)`` with
``q`` [T, H, qk_nope + qk_rope] (``q_pe`` already rotated), ``kv_c`` [T, kv_lora_rank] (normed),
``k_pe`` [T, qk_rope] (rotated); it stores ``[kv_c, k_pe]`` at ``slot_mapping`` and returns
[T, H, v_head_dim] in the query's dtype (padding rows zero). Masking is the causal rule of
:mod:`llmhal.attention.backend` (no sliding window, no soft cap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from llmhal.attention import paged_kv
from llmhal.attention.backend import AttentionBackend, AttentionImpl, AttentionRequirements
from llmhal.attention.layer import Attention
from llmhal.forward_context import get_forward_context


@dataclass(frozen=True)
class MLADims:
    """The sizes of one MLA layer (names as in DeepSeek's configs)."""

    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int

    @property
    def latent_size(self) -> int:
        """Values a token takes in the latent cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class LatentKVLayout:
    """Mixin for MLA backends storing the latent layout of this module (before ``AttentionBackend``
    in the bases)."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: str = "auto",
    ) -> tuple[int, ...]:
        if num_kv_heads != 1:
            raise ValueError(
                f"the MLA latent cache has one KV head (the shared latent), not {num_kv_heads}"
            )
        from llmhal.attention.kv_formats import row_size

        return (num_blocks, block_size, row_size(cache_dtype, head_size))


def write_latent(
    kv_cache: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """Store ``[kv_c, k_pe]`` of the step's tokens at ``slot_mapping`` (-1 = padding, skipped)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    slots, index = paged_kv.written_slots(slot_mapping)
    latent = torch.cat([kv_c[:n], k_pe[:n]], dim=-1)
    if index is not None:
        latent = latent[index]
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    # index_copy_/index_select rather than indexing: on the CPU indexing the whole [slots, L + R]
    # cache took 99 us for a batch-8 decode's 768 bf16 rows, index_select 10 us (one thread).
    stored = paged_kv.quantize_to_cache(latent, kv_cache.dtype, scale)
    if flat.dtype.is_floating_point and flat.element_size() == 1:  # no fp8 index_copy_ on CPU
        flat, stored = flat.view(torch.uint8), stored.view(torch.uint8)
    flat.index_copy_(0, slots, stored)


def read_latent(
    kv_cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The latents stored at ``slots`` (any shape), as ``slots.shape + (latent,)`` in ``dtype``."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    got = flat.index_select(0, slots.reshape(-1).long())
    return paged_kv.dequantize_from_cache(got, scale, dtype).view(*slots.shape, -1)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_nope`` [T, H, nope] in latent space: [T, H, kv_lora_rank] (``w_uk`` [H, nope, L])."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def latent_query(q: torch.Tensor, dims: MLADims, w_uk: torch.Tensor) -> torch.Tensor:
    """A full query [T, H, nope + rope] as the absorbed form attends with it: its nope part in
    latent space beside its rope part, [T, H, kv_lora_rank + rope]."""
    q_nope, q_pe = q.split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)
    return torch.cat([absorb_query(q_nope, w_uk), q_pe], dim=-1)


def unabsorb_output(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Attention output in latent space [T, H, L] to per-head values [T, H, v] (``w_uv``
    [H, v, L])."""
    return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def decompress(
    latent: torch.Tensor, dims: MLADims, w_uk: torch.Tensor, w_uv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys [S, H, nope + rope] and values [S, H, v] of cached latents [S, L + R]."""
    c, k_pe = latent.split([dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)
    k_nope = torch.einsum("sl,hnl->shn", c, w_uk)
    v = torch.einsum("sl,hvl->shv", c, w_uv)
    k_pe = k_pe[:, None, :].expand(-1, dims.num_heads, -1)
    return torch.cat([k_nope, k_pe], dim=-1), v


class MLAImpl(AttentionImpl[Any]):
    """An MLA layer's computation; constructed by :class:`MLAAttention` through the backend.

    The generic constructor arguments describe the cache (one head of ``latent_size``); the MLA
    sizes and weights come from the layer passed to :meth:`forward` (``layer.dims``,
    ``layer.mla_weights(dtype, device)``), so one impl class serves every DeepSeek shape.
    """


class MLABackend(LatentKVLayout, AttentionBackend):
    """Shared declarations of the core MLA backends."""

    kind = "mla"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = (
        "auto",
        "fp8_e4m3",
        "fp8_e5m2",
        "int8",
        "nvfp4",
    )

    @classmethod
    def supports_combination(cls, requirements: AttentionRequirements) -> str | None:
        if requirements.num_kv_heads != 1:
            return f"MLA layers have one latent KV head, not {requirements.num_kv_heads}"
        return None


class MLAAttention(Attention):
    """The MLA layer: ``forward(q, kv_c, k_pe) -> [T, H * v_head_dim]`` over its latent cache.

    ``kv_b_proj`` is the model's up-projection (any linear layer with a quantization method); it is
    held by reference, not as a child, so its parameters keep the model's own names.
    """

    def __init__(
        self, dims: MLADims, scale: float, kv_b_proj: nn.Module, *, prefix: str = ""
    ) -> None:
        super().__init__(dims.num_heads, dims.latent_size, scale, 1, kind="mla", prefix=prefix)
        self.dims = dims
        self._kv_b_proj = (kv_b_proj,)
        self._weights: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._weights_key: tuple[Any, ...] | None = None

    def _source_key(self, device: torch.device) -> tuple[Any, ...]:
        proj = self._kv_b_proj[0]
        params = tuple((p.data_ptr(), p._version, p.shape) for p in proj.parameters())
        # A quantization method may move the weight into kernel objects and free the parameter.
        kernels = tuple(id(k) for k in getattr(proj, "quant_kernels", None) or ())
        return (device, params, kernels)

    def mla_weights(
        self, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(``W_UK`` [H, nope, L], ``W_UV`` [H, v, L]) in ``dtype`` on ``device``, read from
        ``kv_b_proj`` (and read again when its weights change)."""
        key = self._source_key(device)
        if key != self._weights_key:
            self._weights.clear()
            self._weights_key = key
        got = self._weights.get(dtype)
        if got is None:
            got = self._split_kv_b(dtype, device)
            self._weights[dtype] = got
        return got

    def _split_kv_b(
        self, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.dims
        proj = self._kv_b_proj[0]
        if getattr(proj, "bias", None) is not None:
            raise ValueError("MLA's kv_b_proj must have no bias (its weight is split per head)")
        compute = getattr(proj, "params_dtype", None) or torch.float32
        eye = torch.eye(d.kv_lora_rank, dtype=compute, device=device)
        # The layer's output on the identity is its weight's transpose, whatever its storage
        # (quantized rows, a packed layout): [L, H * (nope + v)].
        with torch.no_grad():
            w_t = proj(eye)
        w = w_t.float().t().reshape(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, -1)
        w_uk, w_uv = w.split([d.qk_nope_head_dim, d.v_head_dim], dim=1)
        return w_uk.to(dtype).contiguous(), w_uv.to(dtype).contiguous()

    def forward(  # type: ignore[override]
        self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        meta = get_forward_context().attn_metadata[self.backend.name]
        n, d = q.shape[0], self.dims
        out = self.impl.forward(
            self,
            q.view(n, d.num_heads, d.qk_head_dim),
            kv_c.view(n, d.kv_lora_rank),
            k_pe.view(n, d.qk_rope_head_dim),
            self.kv_cache,
            meta,
        )
        return out.reshape(n, d.num_heads * d.v_head_dim)
