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

from llmhal.quantization.gptq import GPTQConfig, GPTQLinearMethod
from llmhal_cuda.quantization.int4_tinygemm import (
    GROUP_SIZES,
    TinygemmConfigMixin,
    TinygemmMethodMixin,
)


class GPTQMarlinLinearMethod(TinygemmMethodMixin, GPTQLinearMethod):
    method_name = "gptq_marlin"


class GPTQMarlinConfig(TinygemmConfigMixin, GPTQConfig):
    linear_method_cls = GPTQMarlinLinearMethod
    claims = "gptq"

    @classmethod
    def get_name(cls) -> str:
        return "gptq_marlin"

    @classmethod
    def checkpoint_fits(cls, hf_quant_cfg: dict[str, Any]) -> bool:
        bits = hf_quant_cfg.get("bits", hf_quant_cfg.get("w_bit"))
        group = hf_quant_cfg.get("group_size", hf_quant_cfg.get("q_group_size"))
        return bits == 4 and group in GROUP_SIZES and not hf_quant_cfg.get("dynamic")
