"""AWQ: 4-bit group-quantized weights in AutoAWQ's GEMM format (``version: "gemm"``).

Checkpoint tensors per linear layer (K inputs, N outputs, group size g):

``qweight`` int32 [K, N/8]
    word ``[k, j]`` holds outputs ``8j ... 8j+7`` of input ``k``, *interleaved*: slot ``i`` (bits
    ``[4i, 4i+4)``) holds output ``8j + AWQ_ORDER[i]`` with ``AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``;
``qzeros`` int32 [K/g, N/8]
    the zero points, packed the same way;
``scales`` float16 [K/g, N].

Dequantization: ``w[n, k] = scales[k // g, n] * (q[k, n] - z[k // g, n])`` (zero points stored as
is, unlike GPTQ v1). The grouped form is ``scale = s``, ``offset = -z*s``: exact.

Only the GEMM layout with zero points is supported: GEMV checkpoints store a different layout and
``zero_point: false`` checkpoints are not produced by AutoAWQ's standard path; both are refused
with an error that says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmhal.ops.quant_linear import GroupedQuantWeight
from llmhal.quantization.base import QuantizationConfig, QuantizeMethodBase
from llmhal.quantization.grouped_linear import (
    GroupedLinearMethod,
    GroupedPart,
    add_zeros_and_scales,
)
from llmhal.quantization.int_packing import AWQ_ORDER, unpack_int32
from llmhal.quantization.module_names import quantizes_linear
from llmhal.quantization.tracked_params import add_param, check_loaded, layer_name

SUPPORTED_VERSIONS = ("gemm",)


class AWQConfig(QuantizationConfig):
    """``quantization_config`` with ``quant_method: "awq"`` (AutoAWQ, llm-compressor's AWQ export)."""

    # The layer method; platform variants (other kernels) substitute a subclass.
    linear_method_cls: type[AWQLinearMethod]

    def __init__(
        self,
        weight_bits: int,
        group_size: int,
        zero_point: bool = True,
        version: str = "gemm",
        modules_to_not_convert: list[str] | None = None,
    ) -> None:
        super().__init__()
        if weight_bits != 4:
            raise ValueError(f"AWQ with {weight_bits}-bit weights is not supported (4-bit only)")
        if not zero_point:
            raise ValueError(
                "AWQ checkpoints without zero points (zero_point: false) are not supported"
            )
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(
                f"AWQ version {version!r} is not supported; llmhal reads {SUPPORTED_VERSIONS} "
                "checkpoints (re-export the model with AutoAWQ's GEMM version)."
            )
        self.weight_bits = weight_bits
        self.group_size = group_size
        self.zero_point = zero_point
        self.version = version
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    def __repr__(self) -> str:
        return f"AWQConfig(bits={self.weight_bits}, group_size={self.group_size}, version={self.version})"

    @classmethod
    def get_name(cls) -> str:
        return "awq"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        return cls(
            weight_bits=int(cls.get_from_keys(config, ["w_bit", "bits"])),
            group_size=int(cls.get_from_keys(config, ["q_group_size", "group_size"])),
            zero_point=bool(cls.get_from_keys_or(config, ["zero_point"], True)),
            version=str(cls.get_from_keys_or(config, ["version", "format"], "gemm")).lower(),
            modules_to_not_convert=cls.get_from_keys_or(config, ["modules_to_not_convert"], None),
        )

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from llmhal.quantization.expert_linears import declines_router, is_moe_layer, moe_method

        if is_moe_layer(layer):
            return moe_method(self, layer, prefix)
        if declines_router(layer):
            return None
        if not quantizes_linear(
            layer, prefix, self.modules_to_not_convert, self.packed_modules_mapping
        ):
            return None
        return self.linear_method_cls(self)


class AWQLinearMethod(GroupedLinearMethod):
    method_name = "awq"
    # Its checkpoint tensors split across tensor-parallel ranks (llmhal.layers.linear).
    tp_shardable = True
    checkpoint_params = ["qweight", "qzeros", "scales"]  # type: ignore[assignment]

    def __init__(self, config: AWQConfig) -> None:
        self.config = config

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        loader = extra["weight_loader"]
        k, n = input_size, sum(output_sizes)
        g = k if self.config.group_size == -1 else self.config.group_size
        if k % g:
            raise ValueError(
                f"{layer_name(layer)}: AWQ needs the input size ({k}) to be a multiple of the "
                f"group size ({g})"
            )
        if any(s % 8 for s in output_sizes):
            raise ValueError(
                f"{layer_name(layer)}: AWQ packs 8 outputs per int32; output sizes {output_sizes} "
                "are not all multiples of 8"
            )
        layer.awq_group_size = g
        int32 = [torch.int32]
        add_param(layer, "qweight", (k, n // 8), torch.int32, loader, dtypes=int32,
                  input_dim=0, output_dim=1, packed_dim=1, packed_factor=8)  # fmt: skip
        add_zeros_and_scales(layer, loader, k, n, g, 8)

    def grouped_parts(self, layer: nn.Module) -> list[GroupedPart]:
        check_loaded(layer, self.checkpoint_params, "AWQ")
        q = unpack_int32(layer.qweight.data, 4, dim=1, order=AWQ_ORDER).t().contiguous()
        z = unpack_int32(layer.qzeros.data, 4, dim=1, order=AWQ_ORDER).t().to(torch.float32)
        scale = layer.scales.data.t().contiguous()
        weight = GroupedQuantWeight(q, scale, -z * scale, layer.awq_group_size, 4)
        return [GroupedPart(weight)]


AWQConfig.linear_method_cls = AWQLinearMethod
