"""The lightning-attention reference ops against the recurrence written token by token: varlen
batches with odd lengths, block boundaries, states carried in and out, and prefill chunks that
chain into the same result as one pass."""

from __future__ import annotations

import pytest
import torch

from llmhal.ops.linear_attn_ops import (
    decay_rates,
    lightning_attn_decode,
    lightning_attn_prefill,
    lightning_attn_sequential,
)

H, D, DV = 3, 8, 6


def _qkv(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Positive q/k as MiniMax's silu-activated projections mostly are; scaled to keep sums tame.
    return (
        torch.randn(t, H, D, generator=g) * 0.5,
        torch.randn(t, H, D, generator=g) * 0.5,
        torch.randn(t, H, DV, generator=g),
    )


def _loc(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def test_decay_rates_match_minimax_formula():
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    cfg = MiniMaxConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=5, block_size=4)
    for layer in (0, 3, 4):
        ref = MiniMaxLightningAttention(cfg, layer).get_slope_rate().flatten()
        torch.testing.assert_close(decay_rates(4, layer, 5), ref)


@pytest.mark.parametrize("block", [1, 4, 5, 256])
def test_prefill_varlen_matches_sequential(block):
    lens = [1, 7, 12, 4]
    q, k, v = _qkv(sum(lens), 0)
    decay = decay_rates(H, 1, 4)
    states = torch.randn(6, H, D, DV)
    slots = torch.tensor([4, 0, 2, 5], dtype=torch.int32)
    initial = torch.tensor([True, False, True, False])
    before = states.clone()
    out = lightning_attn_prefill(q, k, v, decay, states, _loc(lens), slots, initial, block)
    loc = _loc(lens).tolist()
    for i, slot in enumerate(slots.tolist()):
        a, b = loc[i], loc[i + 1]
        init = before[slot] if initial[i] else None
        ref, final = lightning_attn_sequential(q[a:b], k[a:b], v[a:b], decay, init)
        torch.testing.assert_close(out[a:b], ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(states[slot], final, rtol=1e-4, atol=1e-4)
    # Slots nobody owns are untouched.
    torch.testing.assert_close(states[[1, 3]], before[[1, 3]])


def test_chunks_and_decode_chain_like_one_pass():
    q, k, v = _qkv(13, 1)
    decay = decay_rates(H, 0, 3)
    ref, final = lightning_attn_sequential(q, k, v, decay)
    states = torch.zeros(2, H, D, DV)
    slot = torch.tensor([1], dtype=torch.int32)
    outs = []
    for a, b, init in ((0, 5, False), (5, 11, True)):  # two prefill chunks
        outs.append(
            lightning_attn_prefill(
                q[a:b], k[a:b], v[a:b], decay, states, _loc([b - a]), slot, torch.tensor([init]), 4
            )
        )
    for t in (11, 12):  # then decode steps
        outs.append(
            lightning_attn_decode(q[t : t + 1], k[t : t + 1], v[t : t + 1], decay, states, slot)
        )
    torch.testing.assert_close(torch.cat(outs), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[1], final, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float64])
def test_decode_batch_uses_each_slot(state_dtype):
    """In place on float32 states, through a gathered copy otherwise: the same step."""
    q, k, v = _qkv(3, 2)
    decay = decay_rates(H, 2, 3)
    states = torch.randn(4, H, D, DV, dtype=state_dtype)
    before = states.clone()
    slots = torch.tensor([3, 0, 2], dtype=torch.int32)
    out = lightning_attn_decode(q, k, v, decay, states, slots)
    for i, slot in enumerate(slots.tolist()):
        ref, final = lightning_attn_sequential(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], decay, before[slot]
        )
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[slot].float(), final, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[1], before[1])


def test_prefill_matches_transformers_lightning_block_algorithm():
    """transformers' MiniMaxLightningAttention (its own blockwise loop) on the same q/k/v."""
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    torch.manual_seed(0)
    cfg = MiniMaxConfig(
        hidden_size=H * D, num_attention_heads=H, head_dim=D, num_hidden_layers=3, block_size=4
    )
    layer = MiniMaxLightningAttention(cfg, 1).eval()
    x = torch.randn(1, 10, H * D)
    qkv = torch.nn.functional.silu(layer.qkv_proj(x)).view(10, H, 3 * D)
    q, k, v = qkv.split(D, dim=-1)
    states = torch.zeros(1, H, D, D)
    out = lightning_attn_prefill(
        q, k, v, decay_rates(H, 1, 3), states, _loc([10]), torch.tensor([0], dtype=torch.int32),
        torch.tensor([False]), 4,
    )  # fmt: skip
    gated = torch.sigmoid(layer.output_gate(x[0])) * layer.norm(out.reshape(10, H * D))
    with torch.no_grad():
        ref, _ = layer(x, None, None)
    torch.testing.assert_close(layer.out_proj(gated), ref[0], rtol=1e-4, atol=1e-5)


def test_shape_errors_name_the_layout():
    q, k, v = _qkv(2, 3)
    with pytest.raises(ValueError, match="kv_states must be"):
        lightning_attn_decode(
            q, k, v, decay_rates(H, 0, 2), torch.zeros(1, H, D, D + 1), torch.tensor([0])
        )
