"""``fbgemm_fp8``: FBGEMM's fp8 checkpoints (rowwise weight scales, dynamic per-token activations).

Checkpoint: ``quant_method: "fbgemm_fp8"``, ``activation_scale_ub`` (upper bound of an activation's
absolute value used for its scale), ``modules_to_not_convert``; per layer ``weight``
float8_e4m3fn [N, K] and ``weight_scale`` float32 [N, 1].

Kernels, in order: FBGEMM's ``f8f8bf16_rowwise`` when ``fbgemm-gpu-genai`` is installed
(``pip install fbgemm-gpu-genai``, the release paired with this torch) and its GenAI ops load, on
fp8-capable GPUs (>= 8.9); otherwise torch's own
``torch._scaled_mm`` with rowwise scales (no extra install); on older GPUs, fp8 weights
dequantized per call (core's fp8 weight-only path). Activations are quantized per token with
``scale = min(amax, activation_scale_ub) / 448``.

FBGEMM's ``quantize_fp8_per_row`` reads its input as contiguous bf16 whatever its dtype (1.6.0's
kernel reinterprets the pointer; fp16 activations became garbage), so activations are cast to
contiguous bf16 first; ``f8f8bf16_rowwise`` returns bf16, cast back to the model dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmhal.quantization.base import QuantizationConfig, QuantizeMethodBase
from llmhal.quantization.fp8 import Fp8LinearMethod, Fp8Scheme, fp8_availability, fp8_max
from llmhal.quantization.module_names import quantizes_linear
from llmhal_cuda.libraries import fbgemm_genai_reason


def fbgemm_rowwise_available() -> bool:
    """True when FBGEMM's GenAI fp8 ops load and are registered (see
    :func:`llmhal_cuda.libraries.fbgemm_genai_reason` for why not)."""
    return fbgemm_genai_reason() is None


class FBGEMMFp8Config(QuantizationConfig):
    def __init__(self, ignore_list: list[str] | None, input_scale_ub: float) -> None:
        super().__init__()
        if input_scale_ub <= 0:
            raise ValueError(
                f"fbgemm_fp8 activation_scale_ub must be positive, got {input_scale_ub}"
            )
        self.ignore_list = list(ignore_list or [])
        self.input_scale_ub = float(input_scale_ub)

    def __repr__(self) -> str:
        return f"FBGEMMFp8Config(activation_scale_ub={self.input_scale_ub})"

    @classmethod
    def get_name(cls) -> str:
        return "fbgemm_fp8"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # fp8 matmuls from 8.9; Ampere runs the weight-only fallback in bf16

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FBGEMMFp8Config:
        return cls(
            ignore_list=cls.get_from_keys_or(config, ["modules_to_not_convert"], None),
            input_scale_ub=cls.get_from_keys(config, ["activation_scale_ub"]),
        )

    @classmethod
    def availability(cls, platform: Any) -> list[str]:
        reasons = fp8_availability(platform)
        if platform.device_type != "cuda":
            reasons.append(
                f"fbgemm_fp8 runs on NVIDIA GPUs; this is the {platform.name} platform "
                "(use the core 'fp8' method for fp8 checkpoints elsewhere)"
            )
        return reasons

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not quantizes_linear(layer, prefix, self.ignore_list, self.packed_modules_mapping):
            return None
        return FBGEMMFp8LinearMethod(self.input_scale_ub)


class FBGEMMFp8LinearMethod(Fp8LinearMethod):
    """Core's fp8 method with FBGEMM's activation bound and, when installed, its rowwise GEMM."""

    def __init__(self, input_scale_ub: float) -> None:
        super().__init__(Fp8Scheme(serialized=True))
        self.input_scale_ub = input_scale_ub

    def activation_scale(self, layer: nn.Module, x2: torch.Tensor, per_token: bool) -> torch.Tensor:
        amax = x2.abs().amax(dim=1, keepdim=True) if per_token else x2.abs().amax()
        amax = amax.float().clamp(max=self.input_scale_ub)
        return (amax / fp8_max(layer.fp8_dtype)).clamp(min=1e-12)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.fbgemm_rowwise = (
            layer.fp8_mode == "scaled_mm"
            and layer.weight_fp8.is_cuda
            and fbgemm_rowwise_available()
        )
        if layer.fbgemm_rowwise:  # made once: a tensor per call would copy host -> device
            ub = torch.tensor(self.input_scale_ub, dtype=torch.float32)
            layer.register_buffer("fbgemm_scale_ub", ub.to(layer.weight_fp8.device))

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not getattr(layer, "fbgemm_rowwise", False):
            return super().apply(layer, x, bias)
        import fbgemm_gpu.experimental.gen_ai  # noqa: F401  (registers torch.ops.fbgemm)

        shape = x.shape
        # The quantize kernel reads contiguous bf16 (see the module docstring).
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous()
        ub = layer.fbgemm_scale_ub
        xq, x_scale = torch.ops.fbgemm.quantize_fp8_per_row(x2, None, scale_ub=ub)
        y = torch.ops.fbgemm.f8f8bf16_rowwise(
            xq, layer.weight_fp8, x_scale, layer.weight_scale_rows, use_fast_accum=True
        )
        y = y.to(x.dtype).reshape(*shape[:-1], -1)
        return y if bias is None else y + bias

    def describe(self, layer: nn.Module) -> str:
        if getattr(layer, "fbgemm_rowwise", False):
            return "fbgemm_fp8 -> fbgemm f8f8bf16_rowwise"
        mode = getattr(layer, "fp8_mode", "not loaded")
        why = fbgemm_genai_reason() if mode == "scaled_mm" else None
        return f"fbgemm_fp8 -> {mode}" + (f" (FBGEMM not used: {why})" if why else "")
