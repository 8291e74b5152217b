"""The state-space ops' references (llmhal.ops.mamba_ops) against transformers' own torch paths:
its Mamba and Mamba-2 mixers (prefill without a cache, then prefill and decode with one) rebuilt
from the ops on a varlen batch, its kernel fallbacks op by op, and the chunked SSD scan against
the plain recurrence (chunk boundaries, odd lengths, state carried in and out)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from llmhal.ops import mamba_ops as M
from llmhal.ops.registry import CORE_OPS

LENGTHS = [5, 1, 9]  # prompts of different lengths in one flattened batch


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _qsl(lengths) -> torch.Tensor:
    return _i32([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _randomize(module: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "A_log":
                p.copy_(torch.rand_like(p) * 2 - 1)
            else:
                p.copy_(torch.randn_like(p) * 0.3)
    return module.eval()


@pytest.fixture(scope="module")
def mamba1():
    from transformers.models.mamba.modeling_mamba import MambaMixer

    cfg = transformers.MambaConfig(
        hidden_size=16, intermediate_size=24, state_size=8, conv_kernel=4, time_step_rank=3,
        num_hidden_layers=1, vocab_size=32,
    )  # fmt: skip
    return cfg, _randomize(MambaMixer(cfg, layer_idx=0))


@pytest.fixture(scope="module")
def mamba2():
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    cfg = transformers.Mamba2Config(
        hidden_size=16, expand=2, num_heads=8, head_dim=4, n_groups=2, state_size=8,
        conv_kernel=4, chunk_size=4, num_hidden_layers=1, vocab_size=32,
        time_step_limit=(0.0, 2.0),
    )  # fmt: skip
    return cfg, _randomize(Mamba2Mixer(cfg, layer_idx=0))


class _States:
    """A layer's state tensors with one slot per request, placed at scattered slots."""

    def __init__(self, n, conv_shape, ssm_shape):
        self.slots = _i32([3 * i + 1 for i in range(n)])
        self.conv = torch.full((3 * n + 1, *conv_shape), float("nan"))
        self.ssm = torch.full((3 * n + 1, *ssm_shape), float("nan"))


def _mamba1_step(mixer, h, qsl, st, carried, decode=False):
    """Mamba-1's mixer written with the ops: ``h`` [T, hidden] -> [T, hidden]."""
    inner, n = mixer.intermediate_size, mixer.ssm_state_size
    xs, gate = mixer.in_proj(h).chunk(2, dim=-1)
    w, b = mixer.conv1d.weight[:, 0], mixer.conv1d.bias
    if decode:
        xs = M.causal_conv1d_update(xs, st.conv, w, b, "silu", st.slots)
    else:
        xs = M.causal_conv1d_fn(xs, w, b, st.conv, qsl, st.slots, carried, "silu")
    dt, B, C = mixer.x_proj(xs).split([mixer.time_step_rank, n, n], dim=-1)
    dt = F.linear(dt, mixer.dt_proj.weight)
    A = -torch.exp(mixer.A_log.float())
    if decode:
        y = M.selective_state_update(
            st.ssm[:, None], xs[:, None], dt[:, None], A[None], B[:, None], C[:, None],
            mixer.D[None], gate[:, None], mixer.dt_proj.bias[None], True, st.slots,
        )[:, 0]  # fmt: skip
    else:
        y = M.selective_scan_varlen(
            xs, dt, A, B, C, mixer.D, gate, mixer.dt_proj.bias, True, st.ssm, qsl, st.slots,
            carried,
        )  # fmt: skip
    assert y.shape == (h.shape[0], inner)
    return mixer.out_proj(y)


def _mamba2_step(mixer, h, qsl, st, carried, decode=False):
    """Mamba-2's mixer written with the ops."""
    heads, hp, g, n = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    gate, xbc, dt = mixer.in_proj(h).split([mixer.intermediate_size, mixer.conv_dim, heads], dim=-1)
    w, b = mixer.conv1d.weight[:, 0], mixer.conv1d.bias
    if decode:
        xbc = M.causal_conv1d_update(xbc, st.conv, w, b, "silu", st.slots)
    else:
        xbc = M.causal_conv1d_fn(xbc, w, b, st.conv, qsl, st.slots, carried, "silu")
    x, B, C = xbc.split([mixer.intermediate_size, g * n, g * n], dim=-1)
    t = h.shape[0]
    x, B, C = x.view(t, heads, hp), B.view(t, g, n), C.view(t, g, n)
    A = -torch.exp(mixer.A_log.float())
    if decode:  # expanded (stride-0) per-head parameters, as the layers pass them
        y = M.selective_state_update(
            st.ssm, x, dt[:, :, None].expand(-1, -1, hp), A[:, None, None].expand(-1, hp, n),
            B, C, mixer.D[:, None].expand(-1, hp), None, mixer.dt_bias[:, None].expand(-1, hp),
            True, st.slots,
        )  # fmt: skip
    else:
        y = M.ssd_chunk_scan_varlen(
            x, dt, A, B, C, mixer.chunk_size, mixer.D, mixer.dt_bias, True,
            mixer.time_step_limit, st.ssm, qsl, st.slots, carried,
        )  # fmt: skip
    return mixer.out_proj(mixer.norm(y.reshape(t, -1), gate))


CASES = {
    "mamba1": (_mamba1_step, lambda m: (m.intermediate_size, m.ssm_state_size)),
    "mamba2": (
        _mamba2_step,
        lambda m: (m.num_heads, m.head_dim, m.ssm_state_size),
    ),
}


def _conv_width(mixer):
    return mixer.conv_kernel_size


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
@torch.no_grad()
def test_prefill_matches_hf_mixer_without_cache(arch, request):
    cfg, mixer = request.getfixturevalue(arch)
    step, ssm_shape = CASES[arch]
    torch.manual_seed(1)
    prompts = [torch.randn(n, cfg.hidden_size) for n in LENGTHS]
    conv_dim = getattr(mixer, "conv_dim", getattr(mixer, "intermediate_size", None))
    st = _States(len(prompts), (_conv_width(mixer) - 1, conv_dim), ssm_shape(mixer))
    out = step(mixer, torch.cat(prompts), _qsl(LENGTHS), st, torch.zeros(3, dtype=torch.bool))
    ref = torch.cat([mixer(p[None])[0] for p in prompts])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
@torch.no_grad()
def test_chunked_prefill_and_decode_match_hf_mixer_with_cache(arch, request):
    """Prefill split in two chunks (state carried between them), then 3 batched decode steps,
    against HF's mixer filling its cache one request at a time."""
    cfg, mixer = request.getfixturevalue(arch)
    step, ssm_shape = CASES[arch]
    torch.manual_seed(2)
    prompts = [torch.randn(n, cfg.hidden_size) for n in LENGTHS]
    decodes = torch.randn(3, len(prompts), cfg.hidden_size)
    conv_dim = getattr(mixer, "conv_dim", getattr(mixer, "intermediate_size", None))
    st = _States(len(prompts), (_conv_width(mixer) - 1, conv_dim), ssm_shape(mixer))
    # Chunk 1: each prompt's first 2 tokens (fewer than the conv width: its state keeps zeros).
    first = [p[:2] for p in prompts]
    rest = [p[2:] for p in prompts]
    out1 = step(
        mixer, torch.cat(first), _qsl([len(p) for p in first]), st,
        torch.zeros(3, dtype=torch.bool),
    )  # fmt: skip
    out2 = step(
        mixer, torch.cat(rest), _qsl([len(p) for p in rest]), st,
        torch.ones(3, dtype=torch.bool),
    )  # fmt: skip
    outs = [step(mixer, d, None, st, None, decode=True) for d in decodes]
    for i, p in enumerate(prompts):
        cache = transformers.DynamicCache(config=cfg)
        ref_prefill = mixer(p[None], cache=cache)[0]
        got = torch.cat((out1[_qsl([len(q) for q in first])[i] :][: len(first[i])],
                         out2[_qsl([len(q) for q in rest])[i] :][: len(rest[i])]))  # fmt: skip
        torch.testing.assert_close(got, ref_prefill, atol=2e-5, rtol=1e-4)
        for k, d in enumerate(decodes):
            ref = mixer(d[i][None, None], cache=cache)[0, 0]
            torch.testing.assert_close(outs[k][i], ref, atol=2e-5, rtol=1e-4)
        hf_ssm = cache.layers[0].recurrent_states[0][0]
        torch.testing.assert_close(st.ssm[st.slots[i]].reshape(hf_ssm.shape), hf_ssm)
        hf_conv = cache.layers[0].conv_states[0][0]  # [dim, width]: the last `width` inputs
        torch.testing.assert_close(st.conv[st.slots[i]], hf_conv[:, 1:].t())


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 16])
@pytest.mark.parametrize("groups", [1, 2])
def test_ssd_chunked_equals_sequential_scan(chunk_size, groups):
    torch.manual_seed(3)
    lengths = [7, 0, 1, 12, 4]
    t, heads, hp, n = sum(lengths), 4, 3, 5
    x, dt = torch.randn(t, heads, hp), torch.randn(t, heads)
    A, D, bias = -torch.rand(heads) * 3, torch.randn(heads), torch.randn(heads)
    B, C = torch.randn(t, groups, n), torch.randn(t, groups, n)
    states = torch.randn(9, heads, hp, n)
    seq_states = states.clone()
    slots, carried = _i32([8, 0, 2, 5, 3]), torch.tensor([True, True, False, True, False])
    args = (x, dt, A, B, C)
    rest = (D, bias, True, (0.0, 1.5))
    y = M.ssd_chunk_scan_varlen(*args, chunk_size, *rest, states, _qsl(lengths), slots, carried)
    ref = M.ssd_sequential_scan(*args, 1, *rest, seq_states, _qsl(lengths), slots, carried)
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(states, seq_states, atol=2e-5, rtol=1e-4)
    # The empty request with a carried state kept it; the slots no request names are untouched.
    untouched = [i for i in range(9) if i not in slots.tolist()]
    assert torch.equal(states[untouched], seq_states[untouched])


def test_ssd_matches_hf_chunk_scan_with_initial_state():
    from transformers.models.mamba2 import modeling_mamba2 as hf

    torch.manual_seed(4)
    t, heads, hp, g, n = 11, 4, 3, 2, 5
    x, dt = torch.randn(1, t, heads, hp), torch.randn(1, t, heads)
    A, D, bias = -torch.rand(heads), torch.randn(heads), torch.randn(heads)
    B, C = torch.randn(1, t, g, n), torch.randn(1, t, g, n)
    h0 = torch.randn(1, heads, hp, n)
    ref, final = hf.mamba2_chunk_scan(
        x, dt, A, B, C, 4, D=D, dt_bias=bias, initial_states=h0, dt_softplus=True,
        dt_limit=(0.0, float("inf")), return_final_states=True,
    )  # fmt: skip
    states = torch.zeros(2, heads, hp, n)
    states[1] = h0[0]
    y = M.ssd_chunk_scan_varlen(
        x[0], dt[0], A, B[0], C[0], 4, D, bias, True, (0.0, float("inf")), states,
        _qsl([t]), _i32([1]), torch.tensor([True]),
    )  # fmt: skip
    torch.testing.assert_close(y, ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[1], final[0], atol=1e-5, rtol=1e-5)


def test_conv_state_keeps_carried_rows_for_short_inputs():
    """One new token into a width-4 conv: the state is the last 2 carried rows and the token."""
    dim, width = 3, 4
    weight, states = torch.randn(dim, width), torch.randn(2, width - 1, dim)
    before = states[1].clone()
    x = torch.randn(1, dim)
    y = M.causal_conv1d_fn(
        x, weight, None, states, _qsl([1]), _i32([1]), torch.tensor([True]), None
    )
    torch.testing.assert_close(states[1], torch.cat((before[1:], x)))
    window = torch.cat((before, x))  # [width, dim]
    torch.testing.assert_close(y[0], (window * weight.t()).sum(0))


def test_errors_name_the_remedy():
    w, st = torch.randn(4, 3), torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="'silu'"):
        M.causal_conv1d_update(torch.randn(1, 4), st, w, None, "relu", _i32([0]))
    with pytest.raises(ValueError, match="heads do not split in 2 groups"):
        M.selective_state_update(
            torch.zeros(1, 3, 1, 2), torch.zeros(1, 3, 1), torch.zeros(1, 3, 1),
            torch.zeros(3, 1, 2), torch.zeros(1, 2, 2), torch.zeros(1, 2, 2), None, None, None,
            True, _i32([0]),
        )  # fmt: skip


def test_ops_are_registered():
    for op in (
        "causal_conv1d_fn", "causal_conv1d_update", "selective_scan_varlen",
        "selective_state_update", "ssd_chunk_scan_varlen",
    ):  # fmt: skip
        assert CORE_OPS[op] == f"llmhal.ops.mamba_ops:{op}"
