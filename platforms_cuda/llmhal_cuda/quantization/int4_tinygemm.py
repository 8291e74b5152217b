"""A ``quant_linear``-style kernel on NVIDIA GPUs: torch's built-in int4 tensor-core GEMM.

``torch.ops.aten._weight_int4pack_mm`` ("tinygemm", in every CUDA build of torch, Ampere and
newer) multiplies bf16 activations by int4 weights repacked with ``_convert_weight_to_int4pack``
(input: uint8 [N, K/2], the even element of each pair in the high nibble), dequantizing
``w = (q - 8) * scale + zero`` per group of 32/64/128/256 inputs, with ``scale``/``zero`` packed as
bf16 [K/g, N, 2]. The grouped form ``w = s*q + offset`` maps onto it with ``zero = offset + 8 s``.

vLLM's Marlin kernels live in its compiled ``_C`` extension; the builds other projects ship
(GPTQModel's extension, sgl-kernel) differ in signature and layout, so llmhal's ``gptq_marlin`` /
``awq_marlin`` methods run this kernel instead: nothing to install beyond torch. Scales and zeros are
rounded to bf16 (as the activations are), the same precision trade-off as Marlin's fp16/bf16 path.
"""

from __future__ import annotations

from typing import Any

import torch

from llmhal.ops.quant_linear import GroupedQuantWeight
from llmhal.quantization.grouped_linear import make_kernel

GROUP_SIZES = (32, 64, 128, 256)
MIN_CAPABILITY = 80


def has_tinygemm() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm") and hasattr(ops, "_convert_weight_to_int4pack")


def _inner_k_tiles(k: int) -> int | None:
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    return None


def tinygemm_pack(weight: GroupedQuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [N, K/2] codes as the repack op takes them, bf16 [K/g, N, 2] scales and zeros)."""
    q = weight.qweight
    codes = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
    scale = weight.scale.to(torch.float32)
    offset = weight.offset if weight.offset is not None else torch.zeros_like(scale)
    zero = offset.to(torch.float32) + 8 * scale
    sz = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return codes, sz


class TinygemmInt4Linear:
    """``y = x @ W.T + bias`` through ``_weight_int4pack_mm`` (see the module docstring)."""

    name = "tinygemm_int4"

    def __init__(self, weight: GroupedQuantWeight, act_dtype: torch.dtype) -> None:
        reason = self.supports(weight, act_dtype)
        if reason is not None:
            raise ValueError(f"tinygemm cannot run this weight: {reason}")
        self.shape = weight.shape
        self.group_size = weight.group_size
        codes, self.scales_and_zeros = tinygemm_pack(weight)
        tiles = _inner_k_tiles(self.shape[1])
        self.packed = torch.ops.aten._convert_weight_to_int4pack(codes, tiles)

    @classmethod
    def supports(cls, weight: GroupedQuantWeight, act_dtype: torch.dtype) -> str | None:
        """None when the kernel can run ``weight``; otherwise why not."""
        n, k = weight.shape
        if not has_tinygemm():
            return "this torch build has no _weight_int4pack_mm"
        if weight.qweight.device.type != "cuda":
            return f"the weight is on {weight.qweight.device.type}, the kernel needs a CUDA device"
        if weight.bits != 4:
            return f"{weight.bits}-bit weights (4-bit only)"
        if weight.group_size not in GROUP_SIZES:
            return f"group size {weight.group_size} (supported: {GROUP_SIZES})"
        if n % 8 or _inner_k_tiles(k) is None:
            return f"shape {n}x{k} (N must be a multiple of 8, K of 32)"
        return None

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        # The CUDA kernel checks for a contiguous bf16 A: sliced activations are strided and
        # fp16 models hand over fp16.
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm(
            x2, self.packed, self.group_size, self.scales_and_zeros
        )
        y = y.to(x.dtype).reshape(*shape[:-1], self.shape[0])
        return y if bias is None else y + bias.to(y.dtype)


def cuda_int4_reasons(platform: Any) -> list[str]:
    """Why the int4 tensor-core path cannot run on ``platform`` (empty: it can)."""
    if platform.device_type != "cuda":
        return [f"needs an NVIDIA GPU; the active platform is {platform.name}"]
    if not platform.has_device_capability(MIN_CAPABILITY):
        cap = platform.device_capability()
        have = cap.as_version_str() if cap else "unknown"
        return [f"needs compute capability >= 8.0 (this GPU: {have})"]
    if not has_tinygemm():
        return ["this torch build has no _weight_int4pack_mm (a CUDA build of torch >= 2.5 has)"]
    return []


def tinygemm_or_default(weight: GroupedQuantWeight, act_dtype: torch.dtype) -> Any:
    if TinygemmInt4Linear.supports(weight, act_dtype) is None:
        return TinygemmInt4Linear(weight, act_dtype)
    return make_kernel(weight, act_dtype)


class TinygemmMethodMixin:
    """Layer-method mixin: run each grouped part on tinygemm where it fits."""

    def kernel_for(self, weight: GroupedQuantWeight, act_dtype: torch.dtype) -> Any:
        return tinygemm_or_default(weight, act_dtype)


class TinygemmConfigMixin:
    """Config mixin: needs a >= 8.0 NVIDIA GPU and claims checkpoints of method ``claims`` that
    :meth:`checkpoint_fits` accepts, unless the user asked for another method."""

    claims = ""

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CAPABILITY

    @classmethod
    def availability(cls, platform: Any) -> list[str]:
        return cuda_int4_reasons(platform)

    @classmethod
    def checkpoint_fits(cls, hf_quant_cfg: dict[str, Any]) -> bool:
        raise NotImplementedError

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None
    ) -> str | None:
        from llmhal.platforms import get_current_platform

        name = cls.get_name()  # type: ignore[attr-defined]
        if str(hf_quant_cfg.get("quant_method", "")).lower() != cls.claims:
            return None
        if user_quant not in (None, name) or not cls.checkpoint_fits(hf_quant_cfg):
            return None
        return None if cuda_int4_reasons(get_current_platform()) else name
