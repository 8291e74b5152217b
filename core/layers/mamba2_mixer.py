"""The Mamba-2 mixer (SSD), shared by Mamba2 and the Mamba layers of hybrids (Bamba, ...).

One projection gives the gate ``z``, the conv input ``xBC`` and ``dt``; a depthwise causal conv
(with state) mixes ``xBC`` over time; the selective state-space scan runs per head with a scalar
decay ``A``; a gated RMSNorm (``norm(y * silu(z))`` per group) and the output projection follow.
Decodes take the one-token state update, prefills (and prefill chunks) the chunked SSD scan; both
read and write the request's state slot (see :mod:`llmhal.attention.state`), through the
``mamba_ops`` custom ops, which platforms may override.

Parameter names follow the HF checkpoints (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``,
``norm``, ``out_proj``), so a model loads them by name.
"""

from __future__ import annotations

import torch
from torch import nn

from llmhal.attention.state import RecurrentLayer, StateSpec
from llmhal.layers.layernorm import default_params_dtype
from llmhal.layers.linear import ReplicatedLinear
from llmhal.ops.registry import get_op


def _param(*shape: int, fill: float = 0.0) -> nn.Parameter:
    t = torch.full(shape, fill, dtype=default_params_dtype())
    return nn.Parameter(t, requires_grad=False)


def negated_exp(layer: nn.Module) -> torch.Tensor:
    """``-exp(layer.A_log)`` in float32, computed once per version of the weight: a recorded decode
    step (decode-step graphs) replays native calls only, so no torch op may run in the step."""
    a_log = layer.A_log
    key = (a_log.data_ptr(), a_log._version)
    cached = layer.__dict__.get("_neg_exp_A")
    if cached is None or cached[0] != key:
        cached = (key, -torch.exp(a_log.detach().float()))
        layer.__dict__["_neg_exp_A"] = cached
    return cached[1]


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm_per_group(x * silu(gate))``, computed in float32 (HF's
    ``MambaRMSNormGated``: the gate is applied before normalizing, groups of ``group_size``), through
    the ``gated_rms_norm`` op (one native call on the CPU instead of ~10 torch calls)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"gated RMSNorm: {hidden_size} channels in groups of {group_size}")
        self.weight = _param(hidden_size, fill=1.0)
        self.group_size = group_size
        self.eps = eps
        self._op = get_op("gated_rms_norm")

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return self._op(x, gate, self.weight, self.group_size, self.eps)


class Mamba2Mixer(RecurrentLayer):
    """A Mamba-2 layer over the flattened step (``forward(hidden [T, hidden_size])``)."""

    def __init__(
        self,
        hidden_size: int,
        *,
        num_heads: int,
        head_dim: int,
        state_size: int,
        n_groups: int,
        conv_kernel: int,
        intermediate_size: int,
        chunk_size: int,
        use_bias: bool = False,
        use_conv_bias: bool = True,
        activation: str = "silu",
        norm_eps: float = 1e-5,
        dt_limit: tuple[float, float] = (0.0, float("inf")),
        prefix: str = "",
    ) -> None:
        super().__init__("mamba2", prefix=prefix, head_size=head_dim, num_heads=num_heads)
        if num_heads * head_dim != intermediate_size:
            raise ValueError(
                f"Mamba-2 layer {prefix}: num_heads ({num_heads}) x head_dim ({head_dim}) must "
                f"equal the intermediate size ({intermediate_size})"
            )
        if num_heads % n_groups:
            raise ValueError(f"Mamba-2 layer {prefix}: {num_heads} heads in {n_groups} groups")
        self.num_heads, self.head_dim, self.state_size = num_heads, head_dim, state_size
        self.n_groups, self.conv_kernel = n_groups, conv_kernel
        self.intermediate_size, self.chunk_size = intermediate_size, chunk_size
        self.activation = activation
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.conv_dim = intermediate_size + 2 * n_groups * state_size
        self.in_proj = ReplicatedLinear(
            hidden_size,
            intermediate_size + self.conv_dim + num_heads,
            bias=use_bias,
            prefix=f"{prefix}.in_proj",
        )
        # The checkpoint's nn.Conv1d layout [channels, 1, width]; the ops take [channels, width].
        self.conv1d = nn.Module()
        self.conv1d.weight = _param(self.conv_dim, 1, conv_kernel)
        self.conv1d.bias = _param(self.conv_dim) if use_conv_bias else None
        self.dt_bias = _param(num_heads)
        self.A_log = _param(num_heads)
        self.D = _param(num_heads, fill=1.0)
        self.norm = GatedRMSNorm(intermediate_size, intermediate_size // n_groups, norm_eps)
        self.out_proj = ReplicatedLinear(
            intermediate_size, hidden_size, bias=use_bias, prefix=f"{prefix}.out_proj"
        )
        self._conv_fn = get_op("causal_conv1d_fn")
        self._conv_update = get_op("causal_conv1d_update")
        self._scan = get_op("ssd_chunk_scan_varlen")
        self._update = get_op("selective_state_update")

    def state_specs(self) -> tuple[StateSpec, ...]:
        # Stored as mamba_cache_dtype / mamba_ssm_cache_dtype say (vLLM's defaults: the model's
        # dtype, as transformers keeps them); updated in float32 arithmetic by every kernel.
        return (
            StateSpec("conv", (self.conv_kernel - 1, self.conv_dim), self.conv_state_dtype),
            StateSpec(
                "ssm", (self.num_heads, self.head_dim, self.state_size), self.ssm_state_dtype
            ),
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        meta = self.metadata()
        conv_state, ssm_state = self.states
        H, P, N, G = self.num_heads, self.head_dim, self.state_size, self.n_groups
        inner, gn = self.intermediate_size, G * N
        gate, xbc, dt = self.in_proj(hidden).split([inner, self.conv_dim, H], dim=-1)
        weight = self.conv1d.weight.squeeze(1)
        A = negated_exp(self)
        nd = meta.num_decode_tokens
        outs = []
        if nd:
            idx = meta.decode_state_indices
            c = self._conv_update(
                xbc[:nd], conv_state, weight, self.conv1d.bias, self.activation, idx
            )
            x, B, C = c.split([inner, gn, gn], dim=-1)
            # Per-head parameters as stride-0 [H, P(, N)] views: the update op is per channel.
            y = self._update(
                ssm_state,
                x.reshape(nd, H, P),
                dt[:nd, :, None].expand(nd, H, P),
                A[:, None, None].expand(H, P, N),
                B.reshape(nd, G, N),
                C.reshape(nd, G, N),
                self.D[:, None].expand(H, P),
                None,
                self.dt_bias[:, None].expand(H, P),
                True,
                idx,
            )
            outs.append(y.reshape(nd, inner))
        if meta.num_prefills:
            qsl = meta.prefill_query_start_loc
            idx, init = meta.prefill_state_indices, meta.prefill_has_initial_state
            c = self._conv_fn(
                xbc[nd:], weight, self.conv1d.bias, conv_state, qsl, idx, init, self.activation
            )
            x, B, C = c.split([inner, gn, gn], dim=-1)
            t = x.shape[0]
            y = self._scan(
                x.reshape(t, H, P),
                dt[nd:],
                A,
                B.reshape(t, G, N),
                C.reshape(t, G, N),
                self.chunk_size,
                self.D,
                self.dt_bias,
                True,
                self.dt_limit,
                ssm_state,
                qsl,
                idx,
                init,
            )
            outs.append(y.reshape(t, inner))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
        return self.out_proj(self.norm(y, gate))
