"""Linear attention with a per-head exponential decay (MiniMax's "lightning attention"): the
pure-torch reference ops.

For one head with decay rate ``s`` the layer keeps a ``[D, Dv]`` state

    S_t = exp(-s) * S_{t-1} + k_t^T v_t          o_t = q_t S_t

(no softmax, no scale; the current token sees itself with weight 1). The state replaces a growing KV
cache: it is the request's whole past. Tokens are packed token-major and varlen, as the engine lays
out a step: request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i + 1]`` and state slot
``cache_indices[i]`` of ``kv_states [slots, H, D, Dv]``; the states are read (where
``has_initial_state[i]``, else zeros) and written back in place.

Prefill computes the recurrence blockwise (the algorithm of the lightning-attention paper): inside a
block of ``c`` tokens the exact decayed causal product ``((q k^T) * decay) v`` is one matmul, and the
state carries what came before, so a long prompt costs O(T * c) instead of the O(T^2) of softmax.
The arithmetic runs in float32 whatever the inputs' dtype; the outputs come back in ``q``'s dtype.
"""

from __future__ import annotations

import torch

# Tokens per block of the blockwise prefill (MiniMax's config calls it block_size and uses 256).
DEFAULT_BLOCK = 256


def decay_rates(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """MiniMax-Text-01's per-head decay rates ``s_h`` of layer ``layer_idx`` (float32 [H]).

    ALiBi-like geometric slopes ``(2^(-8/H))^(h+1)``, scaled down linearly with depth (the last
    layer keeps 1e-5 of them: nearly no decay, the longest memory). The tiny epsilons are the
    published model's and must be kept for parity.
    """
    base = 1.0 / (2.0 ** (8.0 / num_heads))
    rates = base ** (torch.arange(num_heads, dtype=torch.float32) + 1)
    depth = 1.0 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return rates * depth


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_states: torch.Tensor) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q, k, v must be [tokens, heads, dim] with equal tokens and heads; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    want = (q.shape[1], q.shape[2], v.shape[2])
    if kv_states.dim() != 4 or tuple(kv_states.shape[1:]) != want:
        raise ValueError(
            f"kv_states must be [slots, heads, head_dim, v_dim] = [slots, {want[0]}, {want[1]}, "
            f"{want[2]}]; got {tuple(kv_states.shape)}"
        )


def lightning_attn_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    kv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    block_size: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """Varlen prefill: ``q``, ``k`` [T, H, D], ``v`` [T, H, Dv], ``decay`` [H] -> [T, H, Dv].

    Each request starts from its slot's state (or zeros) and leaves its final state in the slot, so
    a prompt split into chunks over several steps gives the result of one pass.
    """
    _check(q, k, v, kv_states)
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    out = torch.empty_like(v, dtype=q.dtype)
    s = decay.to(device=q.device, dtype=torch.float32).view(-1, 1, 1)  # [H, 1, 1]
    starts = query_start_loc.tolist()
    slots = cache_indices.tolist()
    initial = has_initial_state.tolist()
    for i, slot in enumerate(slots):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        state = (
            kv_states[slot].float()
            if initial[i]
            else q.new_zeros(kv_states.shape[1:], dtype=torch.float32)
        )
        # Head-major for batched matmuls over heads.
        qs, ks, vs = (t[a:b].float().transpose(0, 1) for t in (q, k, v))
        for c0 in range(0, b - a, block_size):
            c1 = min(c0 + block_size, b - a)
            qb, kb, vb = qs[:, c0:c1], ks[:, c0:c1], vs[:, c0:c1]
            n = c1 - c0
            pos = torch.arange(1, n + 1, device=q.device, dtype=torch.float32).view(1, -1, 1)
            # Row i of the block is i + 1 steps after the state (decayed that much); key j is
            # n - 1 - j steps before the block's end (when it is folded into the next state).
            gap = pos - pos.transpose(1, 2)  # i - j
            intra = torch.where(gap >= 0, torch.exp(-s * gap.clamp(min=0)), 0.0)
            o = (qb * torch.exp(-s * pos)) @ state + ((qb @ kb.transpose(1, 2)) * intra) @ vb
            out[a + c0 : a + c1] = o.transpose(0, 1).to(out.dtype)
            state = (
                state * torch.exp(-s * n) + (kb * torch.exp(-s * (n - pos))).transpose(1, 2) @ vb
            )
        kv_states[slot] = state.to(kv_states.dtype)
    return out


def lightning_attn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    kv_states: torch.Tensor,
    cache_indices: torch.Tensor,
) -> torch.Tensor:
    """One token per request: ``q``, ``k`` [B, H, D], ``v`` [B, H, Dv] -> [B, H, Dv]; the states
    at ``cache_indices`` advance by one step in place."""
    _check(q, k, v, kv_states)
    factor = torch.exp(-decay.to(device=q.device, dtype=torch.float32)).view(-1, 1, 1)
    if kv_states.dtype == torch.float32:
        # Each slot updated where it lies: a gathered copy of the states, the outer products and
        # the scatter back would move several times the state's bytes (measured 23x slower at
        # 8 requests x 64 heads x 128 x 128).
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        qf, kf, vf = q.float(), k.float(), v.float()
        for i, slot in enumerate(cache_indices.tolist()):
            state = kv_states[slot]
            state.mul_(factor).baddbmm_(kf[i].unsqueeze(-1), vf[i].unsqueeze(-2))
            torch.bmm(qf[i].unsqueeze(1), state, out=out[i].unsqueeze(1))
        return out.to(q.dtype)
    idx = cache_indices.long()
    state = kv_states.index_select(0, idx).float() * factor
    state = state + k.float().unsqueeze(-1) * v.float().unsqueeze(-2)  # + k^T v
    out = (q.float().unsqueeze(-2) @ state).squeeze(-2)
    kv_states.index_copy_(0, idx, state.to(kv_states.dtype))
    return out.to(q.dtype)


def lightning_attn_sequential(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence written literally, token by token, for one sequence ([T, H, D]): the
    definition the blockwise prefill and the decode step are tested against. Returns the outputs
    and the final state [H, D, Dv]."""
    s = torch.exp(-decay.float()).view(-1, 1, 1)
    h, d, dv = q.shape[1], q.shape[2], v.shape[2]
    state = torch.zeros(h, d, dv) if state is None else state.float().clone()
    outs = []
    for t in range(q.shape[0]):
        state = s * state + k[t].float().unsqueeze(-1) * v[t].float().unsqueeze(-2)
        outs.append((q[t].float().unsqueeze(-2) @ state).squeeze(-2))
    return torch.stack(outs).to(q.dtype), state
