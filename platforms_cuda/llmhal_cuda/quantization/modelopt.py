"""``modelopt``: checkpoints exported by NVIDIA TensorRT Model Optimizer, FP8 and NVFP4.

The config is ``quantization_config`` (``quant_method: "modelopt"``) or ``hf_quant_config.json``
(``{"producer": ..., "quantization": {...}}``) with ``quant_algo`` ("FP8" or "NVFP4"),
``exclude_modules`` (names or ``*`` wildcards) and, for NVFP4, ``group_size`` (16).

FP8 per layer: ``weight`` float8_e4m3fn [N, K], ``weight_scale`` [] and ``input_scale`` [] (static,
per tensor): served by core's fp8 method (``torch._scaled_mm`` on fp8-capable GPUs). With an fp8
KV cache (``kv_cache_quant_algo: "FP8"``) the attention scales are ``self_attn.k_proj.k_scale`` and
``self_attn.v_proj.v_scale``, mapped onto the attention layer (:meth:`ModelOptConfig.get_cache_scale`).

NVFP4 per layer: ``weight`` uint8 [N, K/2] (two e2m1 codes per byte, the even element in the low
nibble), ``weight_scale`` float8_e4m3fn [N, K/16] (one per 16 inputs), ``weight_scale_2`` float32
[] (global) and ``input_scale`` float32 []:
``w[n, k] = E2M1[code] * weight_scale[n, k // 16] * weight_scale_2``. Computed weight-only: the
codes stay packed (4.5 bits per weight) and are dequantized in row chunks at each call, on any
device. FP4 tensor-core GEMMs (Blackwell, through FlashInfer/CUTLASS) are not wired in yet, so
``get_min_capability`` does not require them.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmhal.quantization.base import QuantizationConfig, QuantizeMethodBase
from llmhal.quantization.fp8 import Fp8LinearMethod, Fp8Scheme, fp8_availability
from llmhal.quantization.module_names import agree, kv_cache_scale_name, name_matches
from llmhal.quantization.tracked_params import (
    add_param,
    add_stash_param,
    check_loaded,
    expect_shape,
    release,
    shard_segments,
)

ALGOS = ("FP8", "NVFP4")
# e2m1: sign bit 3, exponent bits 2-1, mantissa bit 0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
ROWS_PER_CHUNK = 2048


def e2m1_table(device: torch.device | None = None) -> torch.Tensor:
    pos = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos])


class ModelOptConfig(QuantizationConfig):
    def __init__(
        self, quant_algo: str, exclude_modules: list[str] | None = None, group_size: int = 16
    ) -> None:
        super().__init__()
        algo = quant_algo.upper()
        if algo not in ALGOS:
            raise ValueError(
                f"ModelOpt quant_algo {quant_algo!r} is not supported; llmhal reads {ALGOS}"
            )
        if algo == "NVFP4" and group_size != 16:
            raise ValueError(f"NVFP4 uses blocks of 16 inputs; the checkpoint says {group_size}")
        self.quant_algo = algo
        self.exclude_modules = list(exclude_modules or [])
        self.group_size = group_size

    def __repr__(self) -> str:
        return f"ModelOptConfig({self.quant_algo}, exclude={self.exclude_modules})"

    @classmethod
    def get_name(cls) -> str:
        return "modelopt"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["hf_quant_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelOptConfig:
        q = config.get("quantization", config)
        return cls(
            quant_algo=str(cls.get_from_keys(q, ["quant_algo"])),
            exclude_modules=cls.get_from_keys_or(q, ["exclude_modules", "ignore"], None),
            group_size=int(cls.get_from_keys_or(q, ["group_size"], 16)),
        )

    @classmethod
    def availability(cls, platform: Any) -> list[str]:
        return fp8_availability(platform)  # both formats store fp8 tensors (weights or scales)

    def get_cache_scale(self, name: str) -> str | None:
        """ModelOpt writes fp8 KV-cache scales as ``self_attn.k_proj.k_scale`` and
        ``self_attn.v_proj.v_scale``: they go to the attention layer, not to the projections."""
        return kv_cache_scale_name(name)

    def _excluded(self, name: str) -> bool:
        return any(
            fnmatch.fnmatchcase(name, pattern) or name_matches(name, pattern)
            for pattern in self.exclude_modules
        )

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from llmhal.layers.linear import LinearBase

        if not isinstance(layer, LinearBase):
            return None
        if agree(prefix, self.packed_modules_mapping, self._excluded):
            return None
        if self.quant_algo == "FP8":
            return Fp8LinearMethod(Fp8Scheme(serialized=True, static_input_scale=True))
        return NvFp4LinearMethod(self.group_size)


class NvFp4LinearMethod(QuantizeMethodBase):
    """NVFP4 weights kept packed, dequantized in row chunks per call (see the module docstring)."""

    NAMES = ("weight", "weight_scale", "weight_scale_2", "input_scale")

    def __init__(self, group_size: int = 16) -> None:
        self.group_size = group_size

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        loader = extra["weight_loader"]
        n, k = sum(output_sizes), input_size
        if k % self.group_size:
            raise ValueError(
                f"{layer.prefix}: NVFP4 needs the input size ({k}) to be a multiple of "
                f"{self.group_size}"
            )
        add_param(layer, "weight", (n, k // 2), torch.uint8, loader, dtypes=[torch.uint8],
                  output_dim=0, input_dim=1, packed_dim=1, packed_factor=2)  # fmt: skip
        add_param(layer, "weight_scale", (n, k // self.group_size), torch.float8_e4m3fn, loader,
                  dtypes=[torch.float8_e4m3fn], output_dim=0, input_dim=1)  # fmt: skip
        add_stash_param(layer, "weight_scale_2", dtypes=[torch.float32])
        add_stash_param(layer, "input_scale", dtypes=[torch.float32])

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        check_loaded(layer, self.NAMES, "ModelOpt NVFP4")
        rows = []
        for sid, t, size in shard_segments(layer, "weight_scale_2"):
            if t.numel() != 1:
                expect_shape(layer, "weight_scale_2", sid, t, ())
            rows.append(t.reshape(1).float().expand(size))
        # Per-row block scales: the fp8 block scale times the shard's global scale, in float32.
        block = layer.weight_scale.data.to(torch.float32) * torch.cat(rows)[:, None]
        packed = layer.weight.data
        release(layer, self.NAMES)
        layer.register_buffer("nvfp4_packed", packed)
        layer.register_buffer("nvfp4_block_scale", block.contiguous())
        layer.register_buffer("nvfp4_table", e2m1_table(packed.device))

    def dequantize_rows(self, layer: nn.Module, start: int, stop: int) -> torch.Tensor:
        packed = layer.nvfp4_packed[start:stop]
        codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
        values = layer.nvfp4_table[codes.long()]
        scale = layer.nvfp4_block_scale[start:stop].repeat_interleave(self.group_size, dim=1)
        return values * scale

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        n = layer.nvfp4_packed.shape[0]
        outs = [
            F.linear(x, self.dequantize_rows(layer, s, min(s + ROWS_PER_CHUNK, n)).to(x.dtype))
            for s in range(0, n, ROWS_PER_CHUNK)
        ]
        y = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        return y if bias is None else y + bias

    def describe(self, layer: nn.Module) -> str:
        return "modelopt NVFP4 -> weight-only dequant (no fp4 GEMM wired)"
