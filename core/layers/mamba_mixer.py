"""The Mamba-1 mixer (selective scan), for Mamba and FalconMamba.

``in_proj`` gives the scan input ``x`` and the gate ``z``; a depthwise causal conv (with state)
mixes ``x`` over time; ``x_proj`` derives the step size ``dt`` (through ``dt_proj``) and the
input-dependent ``B``/``C``; the selective scan with ``A = -exp(A_log)`` and skip ``D`` runs per
channel and is gated by ``silu(z)``. FalconMamba (``rms_on_dt_b_c``) normalizes ``dt``, ``B`` and
``C`` with a weightless RMSNorm first. Decodes run the one-token state update, prefills the varlen
scan; both read and write the request's state slot through the ``mamba_ops`` custom ops.
"""

from __future__ import annotations

import torch
from torch import nn

from llmhal.attention.state import RecurrentLayer, StateSpec
from llmhal.layers.linear import ReplicatedLinear
from llmhal.layers.mamba2_mixer import _param, negated_exp
from llmhal.ops.registry import get_op


def _weightless_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class MambaMixer(RecurrentLayer):
    """A Mamba-1 layer over the flattened step (``forward(hidden [T, hidden_size])``)."""

    def __init__(
        self,
        hidden_size: int,
        *,
        intermediate_size: int,
        state_size: int,
        conv_kernel: int,
        time_step_rank: int,
        use_bias: bool = False,
        use_conv_bias: bool = True,
        activation: str = "silu",
        rms_on_dt_b_c: bool = False,
        rms_eps: float = 1e-6,
        prefix: str = "",
    ) -> None:
        super().__init__("mamba1", prefix=prefix, head_size=intermediate_size)
        self.inner, self.state_size, self.conv_kernel = intermediate_size, state_size, conv_kernel
        self.time_step_rank, self.activation = time_step_rank, activation
        self.rms_on_dt_b_c, self.rms_eps = rms_on_dt_b_c, rms_eps
        self.in_proj = ReplicatedLinear(
            hidden_size, 2 * intermediate_size, bias=use_bias, prefix=f"{prefix}.in_proj"
        )
        self.conv1d = nn.Module()  # the checkpoint's nn.Conv1d layout [channels, 1, width]
        self.conv1d.weight = _param(intermediate_size, 1, conv_kernel)
        self.conv1d.bias = _param(intermediate_size) if use_conv_bias else None
        self.x_proj = ReplicatedLinear(
            intermediate_size, time_step_rank + 2 * state_size, prefix=f"{prefix}.x_proj"
        )
        self.dt_proj = ReplicatedLinear(
            time_step_rank, intermediate_size, bias=True, prefix=f"{prefix}.dt_proj"
        )
        self.A_log = _param(intermediate_size, state_size)
        self.D = _param(intermediate_size, fill=1.0)
        self.out_proj = ReplicatedLinear(
            intermediate_size, hidden_size, bias=use_bias, prefix=f"{prefix}.out_proj"
        )
        self._conv_fn = get_op("causal_conv1d_fn")
        self._conv_update = get_op("causal_conv1d_update")
        self._scan = get_op("selective_scan_varlen")
        self._update = get_op("selective_state_update")

    def state_specs(self) -> tuple[StateSpec, ...]:
        # Stored as mamba_cache_dtype / mamba_ssm_cache_dtype say (vLLM's defaults: the model's
        # dtype, as transformers keeps them); updated in float32 arithmetic by every kernel.
        return (
            StateSpec("conv", (self.conv_kernel - 1, self.inner), self.conv_state_dtype),
            StateSpec("ssm", (self.inner, self.state_size), self.ssm_state_dtype),
        )

    def _dt_b_c(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ts, B, C = self.x_proj(x).split(
            [self.time_step_rank, self.state_size, self.state_size], dim=-1
        )
        if self.rms_on_dt_b_c:
            ts, B, C = (_weightless_rms(t, self.rms_eps) for t in (ts, B, C))
        return self.dt_proj(ts), B, C  # dt includes dt_proj's bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        meta = self.metadata()
        conv_state, ssm_state = self.states
        x, z = self.in_proj(hidden).chunk(2, dim=-1)
        weight = self.conv1d.weight.squeeze(1)
        A = negated_exp(self)
        nd, d = meta.num_decode_tokens, self.inner
        outs = []
        if nd:
            idx = meta.decode_state_indices
            xc = self._conv_update(
                x[:nd], conv_state, weight, self.conv1d.bias, self.activation, idx
            )
            dt, B, C = self._dt_b_c(xc)
            # One head of d_inner channels: the head-structured update with H = G = 1.
            y = self._update(
                ssm_state.unsqueeze(1), xc[:, None], dt[:, None], A[None], B[:, None],
                C[:, None], self.D[None], z[:nd, None], None, True, idx,
            )  # fmt: skip
            outs.append(y.reshape(nd, d))
        if meta.num_prefills:
            qsl = meta.prefill_query_start_loc
            idx, init = meta.prefill_state_indices, meta.prefill_has_initial_state
            xc = self._conv_fn(
                x[nd:], weight, self.conv1d.bias, conv_state, qsl, idx, init, self.activation
            )
            dt, B, C = self._dt_b_c(xc)
            y = self._scan(xc, dt, A, B, C, self.D, z[nd:], None, True, ssm_state, qsl, idx, init)
            outs.append(y)
        y = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
        return self.out_proj(y)
