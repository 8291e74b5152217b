"""LFM2's gated short convolution: ``out_proj(C * conv(B * x))`` with ``B``, ``C``, ``x`` the three
thirds of ``in_proj(hidden)`` and ``conv`` a depthwise causal convolution of a few taps (LFM2: 3).

Its only memory of the past is the convolution's window, one ``[kernel - 1, hidden]`` conv state
per request (a recurrent layer of kind ``short_conv``, see :mod:`llmhal.attention.state`). The
convolution runs through the dispatched ``causal_conv1d_fn`` / ``causal_conv1d_update`` ops, so a
platform's kernel serves it as it serves Mamba's convolutions. Parameters keep the published names
(``in_proj``, ``conv.weight`` [hidden, 1, kernel], ``conv.bias``, ``out_proj``).
"""

from __future__ import annotations

import torch
from torch import nn

from llmhal.attention.state import RecurrentLayer, StateSpec
from llmhal.layers.linear import ReplicatedLinear
from llmhal.ops.registry import get_op


class DepthwiseConvWeights(nn.Module):
    """The parameters of a depthwise ``nn.Conv1d`` (``weight`` [dim, 1, kernel], ``bias`` [dim]),
    under the names checkpoints use; the convolution itself is an op."""

    def __init__(self, dim: int, kernel_size: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, 1, kernel_size, dtype=dtype), False)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype), False) if bias else None


class ShortConv(RecurrentLayer):
    def __init__(self, hidden_size: int, kernel_size: int, *, bias: bool, prefix: str) -> None:
        super().__init__("short_conv", prefix=prefix, head_size=hidden_size)
        if kernel_size < 2:
            raise ValueError(f"a short convolution needs at least 2 taps, got {kernel_size}")
        self.hidden_size = hidden_size
        self.kernel_size = kernel_size
        self.in_proj = ReplicatedLinear(
            hidden_size, 3 * hidden_size, bias=bias, prefix=f"{prefix}.in_proj"
        )
        self.conv = DepthwiseConvWeights(hidden_size, kernel_size, bias, self.model_dtype)
        self.out_proj = ReplicatedLinear(
            hidden_size, hidden_size, bias=bias, prefix=f"{prefix}.out_proj"
        )
        self._conv_fn = get_op("causal_conv1d_fn")
        self._conv_update = get_op("causal_conv1d_update")

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (StateSpec("conv", (self.kernel_size - 1, self.hidden_size), self.conv_state_dtype),)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        bx = b * x
        meta = self.metadata()
        (conv_state,) = self.states
        weight = self.conv.weight.view(self.hidden_size, self.kernel_size)
        y = torch.zeros_like(bx)  # rows past num_actual_tokens (padding) stay zero
        d, n = meta.num_decode_tokens, meta.num_actual_tokens
        if d:
            y[:d] = self._conv_update(
                bx[:d], conv_state, weight, self.conv.bias, None, meta.decode_state_indices
            )
        if meta.num_prefills:
            y[d:n] = self._conv_fn(
                bx[d:n], weight, self.conv.bias, conv_state, meta.prefill_query_start_loc,
                meta.prefill_state_indices, meta.prefill_has_initial_state, None,
            )  # fmt: skip
        return self.out_proj(c * y)
