"""State-space and short-convolution ops (Mamba-1, Mamba-2, and any layer with a causal conv1d).

Pure-torch definitions: the reference every platform kernel must match, dispatched like the other
custom ops through :func:`llmhal.ops.registry.get_op` (a platform kernel takes the same arguments).

Layout. Batches are token-major and varlen, as the engine flattens them: ``T`` tokens of ``B``
requests, request ``b`` owning rows ``query_start_loc[b]:query_start_loc[b + 1]`` (int32 [B + 1]).
Each request has one state slot per layer, ``cache_indices[b]`` (int32 [B]) into the layer's state
tensors; the ops read the slot's state when ``has_initial_state[b]`` (bool [B]) is true (a request
continuing: chunked prefill, decode) and zeros otherwise, and write the state after their last
token back into the slot, in place, in the state's dtype. Arithmetic is float32 whatever the
activation dtype (the HF slow paths do the scans in float32 too); outputs have the dtype of ``x``.

Signatures:

``causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices,
has_initial_state, activation) -> Tensor``
    ``x`` [T, dim]; ``weight`` [dim, width] (depthwise); ``bias`` [dim] or None; ``conv_states``
    [slots, width - 1, dim]: the last ``width - 1`` inputs seen by the request, oldest first.
    ``out[t] = bias + sum_k weight[:, k] * window[t + k]`` over the request's inputs preceded by
    its state, then ``activation`` (``"silu"``/``"swish"`` or None). The new state is the last
    ``width - 1`` rows of (state, inputs): carried rows stay when fewer inputs than that came.
``causal_conv1d_update(x, conv_states, weight, bias, activation, cache_indices) -> Tensor``
    One new token per request (decode): ``x`` [B, dim]; the state always counts as initial.
``selective_scan_varlen(x, dt, A, B, C, D, z, dt_bias, dt_softplus, ssm_states, query_start_loc,
cache_indices, has_initial_state) -> Tensor``
    Mamba-1 prefill. ``x``/``dt``/``z`` [T, d]; ``A`` [d, n] (already ``-exp(A_log)``); ``B``/``C``
    [T, n]; ``D``/``dt_bias`` [d]; ``ssm_states`` [slots, d, n]. Per token: ``dt' =
    softplus(dt + dt_bias)`` (softplus if ``dt_softplus``), ``h = exp(dt' A) h + dt' B x``,
    ``y = h C + D x``, then ``y *= silu(z)``.
``selective_state_update(ssm_states, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_indices)``
    The same recurrence for one token per request (decode), head-structured: ``ssm_states``
    [slots, H, P, N]; ``x``/``dt``/``z`` [B, H, P]; ``A`` [H, P, N]; ``B``/``C`` [B, G, N] (head
    ``h`` reads group ``h // (H // G)``); ``D``/``dt_bias`` [H, P]. Mamba-1 passes H=1,
    P=d_inner, G=1; Mamba-2 passes expanded (stride-0) views of its per-head A, dt, D, dt_bias.
    Returns y [B, H, P].
``ssd_chunk_scan_varlen(x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit,
ssm_states, query_start_loc, cache_indices, has_initial_state) -> Tensor``
    Mamba-2 prefill. ``x`` [T, H, P]; ``dt`` [T, H]; ``A`` [H]; ``B``/``C`` [T, G, N]; ``D``/
    ``dt_bias`` [H]; ``ssm_states`` [slots, H, P, N]. ``dt' = clamp(softplus(dt + dt_bias),
    *dt_limit)``; per token ``h = exp(dt' A) h + dt' x B^T``, ``y = h C + D x`` (no gate: Mamba-2
    gates in its RMSNorm). Computed with the chunked SSD algorithm (within a chunk, a masked
    attention-like product; across chunks, a scan of the chunk-end states); the result equals
    :func:`ssd_sequential_scan`, the plain recurrence, up to rounding.
``gated_rms_norm(x, gate, weight, group_size, eps) -> Tensor``
    Mamba-2's gated RMSNorm (HF's ``MambaRMSNormGated``): ``x``/``gate`` [T, d] (gate may be
    None), ``weight`` [d]. In float32, ``h = x * silu(gate)`` normalized by the RMS of each group
    of ``group_size`` channels; the result cast to ``x``'s dtype, then times ``weight``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

CONV_ACTIVATIONS = ("silu", "swish")


def check_activation(activation: str | None) -> None:
    if activation is not None and activation not in CONV_ACTIVATIONS:
        raise ValueError(
            f"causal conv1d activation {activation!r} is not supported: use 'silu' (or its alias "
            "'swish') or None"
        )


def _spans(query_start_loc: torch.Tensor) -> list[tuple[int, int]]:
    bounds = query_start_loc.tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _initial(states: torch.Tensor, slot: int, carried: bool) -> torch.Tensor:
    return states[slot].float() if carried else torch.zeros_like(states[slot], dtype=torch.float32)


def _dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float] | None = None,
) -> torch.Tensor:
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit is not None:  # as HF's Mamba-2 scan: clamped even at the default (0, inf)
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None,
) -> torch.Tensor:
    check_activation(activation)
    dim, width = weight.shape
    out = torch.empty_like(x)
    w = weight.float().unsqueeze(1)  # [dim, 1, width]: depthwise conv1d
    b = None if bias is None else bias.float()
    slots, carried = cache_indices.tolist(), has_initial_state.tolist()
    for i, (s, e) in enumerate(_spans(query_start_loc)):
        prev = _initial(conv_states, slots[i], carried[i])  # [width - 1, dim]
        window = torch.cat((prev, x[s:e].float()), 0)  # [width - 1 + L, dim]
        if e > s:
            y = F.conv1d(window.t().unsqueeze(0), w, b, groups=dim)[0].t()  # [L, dim]
            out[s:e] = F.silu(y) if activation is not None else y
        conv_states[slots[i]] = window[window.shape[0] - (width - 1) :]
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    cache_indices: torch.Tensor,
) -> torch.Tensor:
    check_activation(activation)
    idx = cache_indices.long()
    window = torch.cat((conv_states[idx].float(), x.float().unsqueeze(1)), 1)  # [B, width, dim]
    y = (window * weight.float().t()).sum(1)
    if bias is not None:
        y = y + bias.float()
    if activation is not None:
        y = F.silu(y)
    conv_states[idx] = window[:, 1:].to(conv_states.dtype)
    return y.to(x.dtype)


def selective_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    delta = _dt(dt, dt_bias, dt_softplus)  # [T, d]
    xf, Af, Bf, Cf = x.float(), A.float(), B.float(), C.float()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    slots, carried = cache_indices.tolist(), has_initial_state.tolist()
    for i, (s, e) in enumerate(_spans(query_start_loc)):
        h = _initial(ssm_states, slots[i], carried[i])  # [d, n]
        decay = torch.exp(delta[s:e, :, None] * Af)  # [L, d, n]
        inject = (delta[s:e] * xf[s:e])[:, :, None] * Bf[s:e, None, :]  # [L, d, n]
        for t in range(e - s):
            h = decay[t] * h + inject[t]
            y[s + t] = h @ Cf[s + t]
        ssm_states[slots[i]] = h
    if D is not None:
        y += xf * D.float()
    if z is not None:
        y *= F.silu(z.float())
    return y.to(x.dtype)


def selective_state_update(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    heads, groups = x.shape[1], B.shape[1]
    if heads % groups:
        raise ValueError(f"selective_state_update: {heads} heads do not split in {groups} groups")
    idx = state_indices.long()
    delta = _dt(dt, dt_bias, dt_softplus)[..., None]  # [B, H, P, 1]
    Bh = B.float().repeat_interleave(heads // groups, 1)[:, :, None, :]  # [B, H, 1, N]
    Ch = C.float().repeat_interleave(heads // groups, 1)[:, :, :, None]  # [B, H, N, 1]
    xf = x.float()
    h = ssm_states[idx].float() * torch.exp(delta * A.float()) + delta * Bh * xf[..., None]
    ssm_states[idx] = h.to(ssm_states.dtype)
    y = (h @ Ch)[..., 0]  # [B, H, P]
    if D is not None:
        y = y + xf * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: ``out[i, j] = a[j + 1] + ... + a[i]`` for ``j <= i`` (0 on the
    diagonal), -inf above it. Summed term by term down each column rather than as a difference of
    two cumsums, which would cancel catastrophically over a long chunk."""
    n = a.shape[-1]
    ones = torch.ones(n, n, dtype=torch.bool, device=a.device)
    terms = a[..., :, None].expand(*a.shape, n).masked_fill(~ones.tril(-1), 0.0)  # a[i] if i > j
    return terms.cumsum(-2).masked_fill(~ones.tril(), float("-inf"))


def _ssd_one(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    h0: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: x [L, H, P], delta [L, H], A [H], B/C [L, H, N] (per head), h0 [H, P, N], all
    float32 -> (y [L, H, P], final state [H, P, N])."""
    length = x.shape[0]
    ys = []
    h = h0
    for s in range(0, length, chunk_size):
        e = min(s + chunk_size, length)
        xc, bc, cc = x[s:e], B[s:e], C[s:e]
        a = (delta[s:e] * A).t()  # [H, l]: log-decay of each step
        cum = a.cumsum(-1)  # [H, l]
        # Within the chunk: y_i += sum_{j<=i} (C_i . B_j) exp(a_{j+1} + ... + a_i) dt_j x_j.
        decay = torch.exp(_segsum(a))  # [H, l, l]
        scores = torch.einsum("ihn,jhn->hij", cc, bc) * decay
        u = xc * delta[s:e, :, None]  # [l, H, P]
        y = torch.einsum("hij,jhp->ihp", scores, u)
        # From the state carried into the chunk: y_i += exp(a_1 + ... + a_i) C_i . h.
        y = y + torch.einsum("ihn,hpn->ihp", cc, h) * torch.exp(cum).t()[:, :, None]
        # The state after the chunk: decayed carry plus each step's input decayed to the end.
        to_end = torch.exp(cum[:, -1:] - cum).t()  # [l, H]
        h = h * torch.exp(cum[:, -1])[:, None, None] + torch.einsum(
            "jhn,jhp->hpn", bc * to_end[:, :, None], u
        )
        ys.append(y)
    return torch.cat(ys, 0), h


def _ssd_sequential_one(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    h: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_ssd_one`'s result by the plain recurrence, one token at a time."""
    y = torch.empty_like(x)
    for t in range(x.shape[0]):
        h = h * torch.exp(delta[t] * A)[:, None, None] + (
            (delta[t][:, None] * x[t])[:, :, None] * B[t][:, None, :]
        )
        y[t] = torch.einsum("hpn,hn->hp", h, C[t])
    return y, h


def ssd_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    _one: Callable[..., tuple[torch.Tensor, torch.Tensor]] = _ssd_one,
) -> torch.Tensor:
    heads, groups = x.shape[1], B.shape[1]
    if heads % groups:
        raise ValueError(f"ssd_chunk_scan_varlen: {heads} heads do not split in {groups} groups")
    if chunk_size < 1:
        raise ValueError(f"ssd_chunk_scan_varlen: chunk_size must be positive, got {chunk_size}")
    delta = _dt(dt, dt_bias, dt_softplus, dt_limit)  # [T, H]
    xf, Af = x.float(), A.float()
    Bh = B.float().repeat_interleave(heads // groups, 1)
    Ch = C.float().repeat_interleave(heads // groups, 1)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    slots, carried = cache_indices.tolist(), has_initial_state.tolist()
    for i, (s, e) in enumerate(_spans(query_start_loc)):
        h0 = _initial(ssm_states, slots[i], carried[i])
        if e > s:
            y[s:e], h0 = _one(xf[s:e], delta[s:e], Af, Bh[s:e], Ch[s:e], h0, chunk_size)
        ssm_states[slots[i]] = h0
    if D is not None:
        y += xf * D.float()[:, None]
    return y.to(x.dtype)


def ssd_sequential_scan(*args: Any) -> torch.Tensor:
    """:func:`ssd_chunk_scan_varlen` (same arguments; ``chunk_size`` is checked, then unused) by the plain
    recurrence, one token at a time: the definition the chunked algorithm is tested against."""
    return ssd_chunk_scan_varlen(*args, _one=_ssd_sequential_one)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    if gate is not None:
        h = h * F.silu(gate.float())
    g = h.view(*h.shape[:-1], -1, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view(h.shape).to(dtype)
