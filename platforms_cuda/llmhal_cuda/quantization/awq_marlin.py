"""``awq_marlin``: AWQ (GEMM) checkpoints on NVIDIA GPUs with an int4 tensor-core kernel.

Claims ``quant_method: "awq"`` checkpoints on CUDA GPUs with compute capability >= 8.0 when the
group size suits the kernel and the user did not ask for plain ``awq``. Loading is core's AWQ
method; the kernel is torch's tinygemm (:mod:`llmhal_cuda.quantization.int4_tinygemm`).
"""

from __future__ import annotations

from typing import Any

from llmhal.quantization.awq import AWQConfig, AWQLinearMethod
from llmhal_cuda.quantization.int4_tinygemm import (
    GROUP_SIZES,
    TinygemmConfigMixin,
    TinygemmMethodMixin,
)


class AWQMarlinLinearMethod(TinygemmMethodMixin, AWQLinearMethod):
    method_name = "awq_marlin"


class AWQMarlinConfig(TinygemmConfigMixin, AWQConfig):
    linear_method_cls = AWQMarlinLinearMethod
    claims = "awq"

    @classmethod
    def get_name(cls) -> str:
        return "awq_marlin"

    @classmethod
    def checkpoint_fits(cls, hf_quant_cfg: dict[str, Any]) -> bool:
        group = hf_quant_cfg.get("q_group_size", hf_quant_cfg.get("group_size"))
        version = str(hf_quant_cfg.get("version", hf_quant_cfg.get("format", "gemm"))).lower()
        return group in GROUP_SIZES and version == "gemm" and hf_quant_cfg.get("zero_point", True)
