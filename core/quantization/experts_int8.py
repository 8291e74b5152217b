"""``experts_int8``: a mixture-of-experts model's experts quantized to int8 while an unquantized
checkpoint loads (vLLM's method of the same name).

Each expert tensor is quantized as it arrives, so the model-dtype experts never sit in memory
together: symmetric per output channel, ``scale = amax(|row|) / 127`` and ``q = round(w / scale)``.
The experts then hold 1 byte per weight plus one float32 scale per row; ``fused_moe`` runs them
with ``w13_scale``/``w2_scale`` (weight-only int8: activations stay in the model dtype). Every other
layer (attention, router, dense MLPs, embeddings) stays unquantized, as in vLLM.

Use: ``LLM(model, quantization="experts_int8")`` on an unquantized checkpoint of a MoE model. A
dense model loads unchanged (it has no experts to quantize).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmhal.layers.fused_moe import (
    FusedMoE,
    FusedMoEMethodBase,
    ShardId,
    expert_param,
    expert_rows,
    expert_shapes,
)
from llmhal.layers.weights import copy_checked
from llmhal.quantization.base import QuantizationConfig, QuantizeMethodBase

INT8_MAX = 127.0


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per last-dimension row: (int8 values, float32 scale of shape ``w.shape[:-1]``)."""
    wf = w.to(torch.float32)
    scale = wf.abs().amax(dim=-1).clamp(min=1e-12) / INT8_MAX
    q = (wf / scale.unsqueeze(-1)).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class ExpertsInt8Config(QuantizationConfig):
    """Online int8 experts; needs nothing from the checkpoint."""

    @classmethod
    def get_name(cls) -> str:
        return "experts_int8"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ExpertsInt8Config:
        return cls()

    @classmethod
    def is_online(cls) -> bool:
        return True

    @classmethod
    def online_config(cls) -> ExpertsInt8Config:
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        return ExpertsInt8MoEMethod() if isinstance(layer, FusedMoE) else None


class ExpertsInt8MoEMethod(FusedMoEMethodBase):
    """int8 ``w13_weight``/``w2_weight`` with float32 buffers ``w13_scale`` [E, 2I], ``w2_scale``
    [E, H]."""

    # Under tensor parallelism each rank quantizes its slice of every expert as it loads (the
    # down projection's rows then get one scale per rank's slice, as in vLLM).
    tp_shardable = True

    def create_weights(  # type: ignore[override]
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        def load(param: torch.Tensor, loaded: torch.Tensor, shard: ShardId) -> None:
            scale = layer.w13_scale if param is layer.w13_weight else layer.w2_scale
            q, s = quantize_rows(loaded)
            what = f"expert {shard[0]} {shard[1]}"
            copy_checked(expert_rows(param.data, shard, intermediate_size), q, what)
            copy_checked(expert_rows(scale, shard, intermediate_size), s, f"{what} scale")

        for name, shape in expert_shapes(num_experts, hidden_size, intermediate_size).items():
            layer.register_parameter(f"{name}_weight", expert_param(shape, torch.int8, load))
            layer.register_buffer(f"{name}_scale", torch.empty(shape[:2], dtype=torch.float32))

    def apply(  # type: ignore[override]
        self, layer: nn.Module, x: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        return layer.run_op(
            x,
            layer.w13_weight,
            layer.w2_weight,
            router_logits,
            w13_scale=layer.w13_scale,
            w2_scale=layer.w2_scale,
        )

    def describe(self, layer: nn.Module) -> str:
        return "experts_int8 (int8 per-channel experts, weight-only)"
