"""``awq_marlin``: AWQ (GEMM) checkpoints on NVIDIA GPUs with an int4 tensor-core kernel.

Claims ``quant_method: "awq"`` checkpoints on CUDA GPUs with compute capability >= 8.0 when the
group size suits the kernel and the user did not ask for plain ``awq``. Loading is core's AWQ
method; the kernel is torch's tinygemm (:mod:`llmhal_cuda.quantization.int4_tinygemm`).
"""

from __future__ import annotations

from typing import Any

import torch

from llmhal.ops.quant_linear import GroupedQuantWeight
from llmhal.quantization.awq import AWQConfig, AWQLinearMethod
from llmhal_cuda.quantization.int4_tinygemm import (
    GROUP_SIZES,
    MIN_CAPABILITY,
    cuda_int4_reasons,
    tinygemm_or_default,
)


class AWQMarlinLinearMethod(AWQLinearMethod):
    method_name = "awq_marlin"

    def kernel_for(self, weight: GroupedQuantWeight, act_dtype: torch.dtype) -> Any:
        return tinygemm_or_default(weight, act_dtype)


class AWQMarlinConfig(AWQConfig):
    linear_method_cls = AWQMarlinLinearMethod

    @classmethod
    def get_name(cls) -> str:
        return "awq_marlin"

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
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None
    ) -> str | None:
        from llmhal.platforms import get_current_platform

        if str(hf_quant_cfg.get("quant_method", "")).lower() != "awq":
            return None
        if user_quant not in (None, "awq_marlin"):
            return None
        group = hf_quant_cfg.get("q_group_size", hf_quant_cfg.get("group_size"))
        version = str(hf_quant_cfg.get("version", hf_quant_cfg.get("format", "gemm"))).lower()
        if group not in GROUP_SIZES or version != "gemm" or hf_quant_cfg.get("zero_point") is False:
            return None
        return None if cuda_int4_reasons(get_current_platform()) else "awq_marlin"
