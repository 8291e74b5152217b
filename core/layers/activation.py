"""Gated activations, through the dispatched ops."""

from __future__ import annotations

import torch
from torch import nn

from llmhal.ops.registry import get_op


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` [..., 2d]: the SwiGLU gate on a fused gate/up
    projection."""

    def __init__(self) -> None:
        super().__init__()
        self._op = get_op("silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x)


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation for an HF ``hidden_act`` name, or an error listing the supported ones."""
    if hidden_act in ("silu", "swish"):
        return SiluAndMul()
    raise ValueError(
        f"hidden_act={hidden_act!r} is not supported for gated MLPs; supported: silu (swish)"
    )
