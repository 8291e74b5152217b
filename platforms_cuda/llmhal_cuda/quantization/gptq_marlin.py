"""``gptq_marlin``: GPTQ checkpoints on NVIDIA GPUs with an int4 tensor-core kernel.

Claims ``quant_method: "gptq"`` checkpoints (``override_quantization_method``) when the active
platform is CUDA with compute capability >= 8.0, the checkpoint is 4-bit with a group size the
kernel takes (32/64/128/256), torch has the kernel, and the user did not ask for plain ``gptq``.
Loading, act-order and the zero-point conventions are core's GPTQ method
(:mod:`llmhal.quantization.gptq`); only the kernel differs: torch's tinygemm (see
:mod:`llmhal_cuda.quantization.int4_tinygemm` for why not Marlin itself). Weights the kernel cannot
take fall back to the platform's ``quant_linear``.
"""

from __future__ import annotations

from typing import Any

import torch

from llmhal.ops.quant_linear import GroupedQuantWeight
from llmhal.quantization.gptq import GPTQConfig, GPTQLinearMethod
from llmhal_cuda.quantization.int4_tinygemm import (
    GROUP_SIZES,
    MIN_CAPABILITY,
    cuda_int4_reasons,
    tinygemm_or_default,
)


class GPTQMarlinLinearMethod(GPTQLinearMethod):
    method_name = "gptq_marlin"

    def kernel_for(self, weight: GroupedQuantWeight, act_dtype: torch.dtype) -> Any:
        return tinygemm_or_default(weight, act_dtype)


class GPTQMarlinConfig(GPTQConfig):
    linear_method_cls = GPTQMarlinLinearMethod

    @classmethod
    def get_name(cls) -> str:
        return "gptq_marlin"

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

        if str(hf_quant_cfg.get("quant_method", "")).lower() != "gptq":
            return None
        if user_quant not in (None, "gptq_marlin"):
            return None
        bits = hf_quant_cfg.get("bits", hf_quant_cfg.get("w_bit"))
        group = hf_quant_cfg.get("group_size", hf_quant_cfg.get("q_group_size"))
        if bits != 4 or group not in GROUP_SIZES or hf_quant_cfg.get("dynamic"):
            return None
        return None if cuda_int4_reasons(get_current_platform()) else "gptq_marlin"
