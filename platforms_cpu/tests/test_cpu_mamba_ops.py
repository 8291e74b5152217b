"""The CPU platform's state-space kernels (``llmhal_cpu.mamba_kernels``, ``kernels/mamba_ops.cpp``)
against core's references: random shapes, odd and empty requests, scattered slots, state carried
in and out, strided and stride-0 views, bfloat16 activations, the fallbacks, and replay in a
decode-step graph; and the decode step of MiniMax's lightning attention."""

from __future__ import annotations

import pytest
import torch

from llmhal.ops import mamba_ops as ref
from llmhal_cpu import mamba_kernels as K
from llmhal_cpu import step_graph
from llmhal_cpu.platform import CpuPlatform

needs_kernel = pytest.mark.skipif(
    K.LIBRARY.get() is None, reason=f"mamba_ops unavailable: {K.status()}"
)
TOL = dict(atol=3e-5, rtol=1e-4)  # sum order over N, a 1-ulp vector exp (Mamba-1's decay)
OPS = (
    "causal_conv1d_fn", "causal_conv1d_update", "selective_scan_varlen",
    "selective_state_update", "ssd_chunk_scan_varlen", "gated_rms_norm",
)  # fmt: skip


@pytest.fixture
def no_fallback(monkeypatch):
    """Make every reference raise, so a test proves the kernel itself ran."""

    def refuse(*args, **kwargs):
        raise AssertionError("the kernel fell back to the reference")

    saved = {op: getattr(ref, op) for op in OPS}
    for op in OPS:
        monkeypatch.setattr(ref, op, refuse)
    return saved


def _batch(g: torch.Generator, n_req: int, max_len: int):
    lengths = torch.randint(0, max_len + 1, (n_req,), generator=g)
    qsl = torch.cat((torch.zeros(1), lengths.cumsum(0))).to(torch.int32)
    slots = torch.randperm(2 * n_req + 1, generator=g)[:n_req].to(torch.int32)
    carried = torch.rand(n_req, generator=g) < 0.5
    return int(lengths.sum()), qsl, slots, carried, 2 * n_req + 1


def _pair(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return t, t.clone()


def test_registered_as_the_cpu_kernels():
    for op in (*OPS, "lightning_attn_decode"):
        assert CpuPlatform.op_kernels[op] == f"llmhal_cpu.mamba_kernels:{op}"
        assert getattr(K, op).status is K.status


@needs_kernel
@pytest.mark.parametrize("seed", range(6))
def test_conv_matches_reference(seed, no_fallback):
    g = torch.Generator().manual_seed(seed)
    width, dim = 2 + seed % 4, int(torch.randint(1, 150, (1,), generator=g))
    t, qsl, slots, carried, n_slots = _batch(g, 1 + seed % 4, 9)
    # x: a column slice of a wider projection output (rows `3 * dim` apart)
    x = torch.randn(t, 3 * dim, generator=g)[:, dim : 2 * dim]
    weight = torch.randn(dim, width, generator=g)
    bias = torch.randn(dim, generator=g) if seed % 2 else None
    act = "silu" if seed % 3 else None
    mine, theirs = _pair(torch.randn(n_slots, width - 1, dim, generator=g))
    args = (qsl, slots, carried, act)
    out = K.causal_conv1d_fn(x, weight, bias, mine, *args)
    want = no_fallback["causal_conv1d_fn"](x, weight, bias, theirs, *args)
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(mine, theirs, atol=0, rtol=0)  # copies only
    # then two decode steps of the same requests
    for _ in range(2):
        xu = torch.randn(len(slots), dim, generator=g)
        out = K.causal_conv1d_update(xu, mine, weight, bias, act, slots)
        want = no_fallback["causal_conv1d_update"](xu, theirs, weight, bias, act, slots)
        torch.testing.assert_close(out, want, **TOL)
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)


@needs_kernel
@pytest.mark.parametrize("seed", range(4))
def test_mamba1_scan_and_update_match_reference(seed, no_fallback):
    g = torch.Generator().manual_seed(10 + seed)
    d, n, rank = int(torch.randint(1, 70, (1,), generator=g)), (4, 16, 7, 1)[seed], 3
    t, qsl, slots, carried, n_slots = _batch(g, 1 + seed, 13)
    x, z, dt = (torch.randn(t, d, generator=g) for _ in range(3))
    proj = torch.randn(t, rank + 2 * n, generator=g)  # B and C: slices of x_proj's output
    B, C = proj[:, rank : rank + n], proj[:, rank + n :]
    A = -torch.rand(d, n, generator=g) * 4
    D, bias = torch.randn(d, generator=g), torch.randn(d, generator=g)
    mine, theirs = _pair(torch.randn(n_slots, d, n, generator=g))
    opt = (D, z, bias) if seed % 2 else (None, None, None)
    args = (*opt, True, None, qsl, slots, carried)
    out = K.selective_scan_varlen(x, dt, A, B, C, *args[:4], mine, *args[5:])
    want = no_fallback["selective_scan_varlen"](x, dt, A, B, C, *args[:4], theirs, *args[5:])
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(mine, theirs, **TOL)
    # decode, as Mamba-1 calls it: H = 1, P = d, G = 1
    b = len(slots)
    xs, zs, dts = (torch.randn(b, 1, d, generator=g) for _ in range(3))
    Bs, Cs = torch.randn(b, 1, n, generator=g), torch.randn(b, 1, n, generator=g)
    Ds, zs2, bs = (D[None], zs, bias[None]) if seed % 2 else (None, None, None)
    out = K.selective_state_update(
        mine[:, None], xs, dts, A[None], Bs, Cs, Ds, zs2, bs, True, slots
    )
    want = no_fallback["selective_state_update"](
        theirs[:, None], xs, dts, A[None], Bs, Cs, Ds, zs2, bs, True, slots
    )
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(mine, theirs, **TOL)


def _mamba2_decode_args(g, states, b, heads, hp, n, groups, A, D, bias):
    """Mamba-2's decode arguments: per-head A/dt/D/dt_bias expanded with stride 0."""
    x = torch.randn(b, heads * hp, generator=g).view(b, heads, hp)
    dt = torch.randn(b, heads, generator=g)
    bc = torch.randn(b, 2 * groups * n, generator=g)
    B, C = bc[:, : groups * n].view(b, groups, n), bc[:, groups * n :].view(b, groups, n)
    return (
        states, x, dt[:, :, None].expand(-1, -1, hp), A[:, None, None].expand(-1, hp, n), B, C,
        D[:, None].expand(-1, hp), None, bias[:, None].expand(-1, hp), True,
    )  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("seed", range(4))
def test_mamba2_scan_and_update_match_reference(seed, no_fallback):
    g = torch.Generator().manual_seed(20 + seed)
    groups = (1, 2, 4, 1)[seed]
    heads, hp, n = groups * (1 + seed % 3), (4, 3, 8, 1)[seed], (16, 5, 8, 3)[seed]
    t, qsl, slots, carried, n_slots = _batch(g, 1 + seed, 11)
    chunk = (4, 1, 3, 8)[seed]
    # x, B, C: views of one conv output, as Mamba-2 splits it; dt: a column slice
    xbc = torch.randn(t, heads * hp + 2 * groups * n, generator=g)
    x = xbc[:, : heads * hp].view(t, heads, hp)
    B = xbc[:, heads * hp : heads * hp + groups * n].view(t, groups, n)
    C = xbc[:, heads * hp + groups * n :].view(t, groups, n)
    dt = torch.randn(t, heads + 5, generator=g)[:, 2 : 2 + heads]
    A = -torch.rand(heads, generator=g) * 3
    D, bias = torch.randn(heads, generator=g), torch.randn(heads, generator=g)
    limit = ((0.0, float("inf")), (0.01, 0.5))[seed % 2]
    mine, theirs = _pair(torch.randn(n_slots, heads, hp, n, generator=g))
    tail = (qsl, slots, carried)
    out = K.ssd_chunk_scan_varlen(x, dt, A, B, C, chunk, D, bias, True, limit, mine, *tail)
    want = no_fallback["ssd_chunk_scan_varlen"](
        x, dt, A, B, C, chunk, D, bias, True, limit, theirs, *tail
    )
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(mine, theirs, **TOL)
    for _ in range(2):
        args = _mamba2_decode_args(g, mine, len(slots), heads, hp, n, groups, A, D, bias)
        out = K.selective_state_update(*args, slots)
        want = no_fallback["selective_state_update"](theirs, *args[1:], slots)
        torch.testing.assert_close(out, want, **TOL)
        torch.testing.assert_close(mine, theirs, **TOL)


@needs_kernel
def test_other_dtypes_and_layouts_use_the_reference():
    g = torch.Generator().manual_seed(5)
    weight, states = torch.randn(6, 4, generator=g), torch.zeros(3, 3, 6)
    x16 = torch.randn(2, 6, generator=g).bfloat16()
    out = K.causal_conv1d_update(x16, states.clone(), weight, None, "silu", torch.tensor([0, 2]))
    want = ref.causal_conv1d_update(x16, states.clone(), weight, None, "silu", torch.tensor([0, 2]))
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)  # int64 slots, bf16: reference
    # columns with a stride (not a layout the kernel reads): same values through the reference
    xs = torch.randn(2, 12, generator=g)[:, ::2]
    idx = torch.tensor([1, 0], dtype=torch.int32)
    s1, s2 = states.clone(), states.clone()
    out = K.causal_conv1d_update(xs, s1, weight, None, None, idx)
    torch.testing.assert_close(out, ref.causal_conv1d_update(xs, s2, weight, None, None, idx))
    torch.testing.assert_close(s1, s2)


@needs_kernel
def test_bad_slot_raises_like_the_reference_and_writes_nothing():
    states = torch.randn(2, 3, 6)
    before = states.clone()
    with pytest.raises(IndexError):
        K.causal_conv1d_update(
            torch.randn(1, 6), states, torch.randn(6, 4), None, None,
            torch.tensor([2], dtype=torch.int32),
        )  # fmt: skip
    assert torch.equal(states, before)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,width,group", [(8, 1536, 1536), (3, 96, 48), (5, 37, 37)])
def test_gated_rms_norm_matches_reference(tokens, width, group, dtype, no_fallback):
    """Mamba-2's gated norm, gate a strided slice of a projection's output as the mixer passes it,
    and without a gate: float32 within 1e-6, bf16 rounded as torch rounds (a flip in 1e3 at most)."""
    g = torch.Generator().manual_seed(width + group)
    proj = torch.randn(tokens, 2 * width + 5, generator=g).to(dtype)
    x = torch.randn(tokens, width, generator=g).to(dtype)
    w = torch.randn(width, generator=g).to(dtype)
    for gate in (proj[:, 3 : 3 + width], None):
        got = K.gated_rms_norm(x, gate, w, group, 1e-5)
        want = no_fallback["gated_rms_norm"](x, gate, w, group, 1e-5)
        assert got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        else:
            torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
            assert (got != want).float().mean() <= 1e-3


@needs_kernel
def test_gated_rms_norm_hands_other_layouts_to_the_reference():
    x = torch.randn(4, 32)
    for args in ((x.half(), None, torch.ones(32).half(), 32),
                 (x.t().contiguous().t(), None, torch.ones(32), 32)):  # fmt: skip
        torch.testing.assert_close(
            K.gated_rms_norm(*args, 1e-6), ref.gated_rms_norm(*args, 1e-6), atol=0, rtol=0
        )
    with pytest.raises(RuntimeError):  # groups that do not divide the width: torch's error
        K.gated_rms_norm(x, None, torch.ones(32), 5, 1e-6)


@needs_kernel
def test_decode_calls_replay_in_a_step_graph():
    g = torch.Generator().manual_seed(6)
    heads, hp, n, groups, dim, b = 4, 8, 16, 2, 40, 3
    conv_states, ssm = torch.zeros(5, 3, dim), torch.zeros(5, heads, hp, n)
    weight = torch.randn(dim, 4, generator=g)
    A, D, bias = -torch.rand(heads, generator=g), torch.randn(heads), torch.randn(heads)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    xin = torch.randn(b, dim, generator=g)
    args = _mamba2_decode_args(g, ssm, b, heads, hp, n, groups, A, D, bias)

    def step():
        conv = K.causal_conv1d_update(xin, conv_states, weight, None, "silu", slots)
        return conv, K.selective_state_update(*args, slots)

    (conv_out, y), graph, reason = step_graph.capture(step)
    assert reason is None and graph is not None and graph.num_calls == 2
    for seed in (7, 8):
        xin.copy_(torch.randn(b, dim, generator=torch.Generator().manual_seed(seed)))
        args[1].copy_(torch.randn(b, heads, hp, generator=torch.Generator().manual_seed(seed)))
        expect_conv, expect_ssm = conv_states.clone(), ssm.clone()
        want_conv = ref.causal_conv1d_update(xin, expect_conv, weight, None, "silu", slots)
        want_y = ref.selective_state_update(expect_ssm, *args[1:], slots)
        graph.replay()
        torch.testing.assert_close(conv_out, want_conv, **TOL)
        torch.testing.assert_close(y, want_y, **TOL)
        torch.testing.assert_close(conv_states, expect_conv, **TOL)
        torch.testing.assert_close(ssm, expect_ssm, **TOL)


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_full_width_mamba2_layer_matches_reference(threads, no_fallback):
    """Mamba-2 at 768 wide (24 heads x 64, N = 128, conv over 1792 channels): a 300-token prompt
    over chunk boundaries next to a carried one, then a decode step, on one and two threads."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(9)
        heads, hp, n, groups, width = 24, 64, 128, 1, 4
        dim = heads * hp + 2 * groups * n
        qsl = torch.tensor([0, 300, 301], dtype=torch.int32)
        slots, carried = torch.tensor([1, 0], dtype=torch.int32), torch.tensor([False, True])
        xbc = torch.randn(301, dim, generator=g)
        weight, cbias = torch.randn(dim, width, generator=g) * 0.3, torch.randn(dim, generator=g)
        c_mine, c_theirs = _pair(torch.randn(2, width - 1, dim, generator=g))
        out = K.causal_conv1d_fn(xbc, weight, cbias, c_mine, qsl, slots, carried, "silu")
        want = no_fallback["causal_conv1d_fn"](
            xbc, weight, cbias, c_theirs, qsl, slots, carried, "silu"
        )
        torch.testing.assert_close(out, want, **TOL)
        x = out[:, : heads * hp].view(301, heads, hp)
        B = out[:, heads * hp : heads * hp + n].view(301, 1, n)
        C = out[:, heads * hp + n :].view(301, 1, n)
        dt, A = torch.randn(301, heads, generator=g), -torch.rand(heads, generator=g) * 4
        D, bias = torch.randn(heads, generator=g), torch.randn(heads, generator=g)
        mine, theirs = _pair(torch.randn(2, heads, hp, n, generator=g) * 0.1)
        lim = (0.0, float("inf"))
        y = K.ssd_chunk_scan_varlen(
            x, dt, A, B, C, 256, D, bias, True, lim, mine, qsl, slots, carried
        )
        want = no_fallback["ssd_chunk_scan_varlen"](
            x, dt, A, B, C, 256, D, bias, True, lim, theirs, qsl, slots, carried
        )
        torch.testing.assert_close(y, want, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(mine, theirs, atol=2e-4, rtol=2e-4)
        # then a decode step of both requests (split over the threads by head and channel block)
        args = _mamba2_decode_args(g, mine, 2, heads, hp, n, groups, A, D, bias)
        out = K.selective_state_update(*args, slots)
        want = no_fallback["selective_state_update"](theirs, *args[1:], slots)
        torch.testing.assert_close(out, want, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(mine, theirs, atol=2e-4, rtol=2e-4)
    finally:
        torch.set_num_threads(prev)


@needs_kernel
def test_bfloat16_activations_match_reference(no_fallback):
    """A bf16 model: activations, conv weights and conv state in bf16, SSM state and A float32,
    D and dt_bias bf16. Both sides compute in float32 and round the outputs once."""
    g = torch.Generator().manual_seed(30)
    bf = torch.bfloat16
    t, qsl, slots, carried, n_slots = _batch(g, 3, 9)
    dim, width = 70, 4
    x = torch.randn(t, dim, generator=g).to(bf)
    weight, bias = torch.randn(dim, width, generator=g).to(bf), torch.randn(dim, generator=g).to(bf)
    mine, theirs = _pair(torch.randn(n_slots, width - 1, dim, generator=g).to(bf))
    out = K.causal_conv1d_fn(x, weight, bias, mine, qsl, slots, carried, "silu")
    want = no_fallback["causal_conv1d_fn"](x, weight, bias, theirs, qsl, slots, carried, "silu")
    assert out.dtype == bf
    torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)
    assert torch.equal(mine, theirs)
    xu = torch.randn(len(slots), dim, generator=g).to(bf)
    out = K.causal_conv1d_update(xu, mine, weight, bias, "silu", slots)
    want = no_fallback["causal_conv1d_update"](xu, theirs, weight, bias, "silu", slots)
    torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)
    assert torch.equal(mine, theirs)
    # Mamba-2: prefill then decode
    heads, hp, n, groups = 4, 8, 16, 2
    xs = torch.randn(t, heads, hp, generator=g).to(bf)
    dt = torch.randn(t, heads, generator=g).to(bf)
    B, C = (torch.randn(t, groups, n, generator=g).to(bf) for _ in range(2))
    A = -torch.rand(heads, generator=g) * 3
    D, db = torch.randn(heads, generator=g).to(bf), torch.randn(heads, generator=g).to(bf)
    s1, s2 = _pair(torch.randn(n_slots, heads, hp, n, generator=g))
    lim = (0.0, float("inf"))
    y = K.ssd_chunk_scan_varlen(xs, dt, A, B, C, 4, D, db, True, lim, s1, qsl, slots, carried)
    want = no_fallback["ssd_chunk_scan_varlen"](
        xs, dt, A, B, C, 4, D, db, True, lim, s2, qsl, slots, carried
    )
    assert y.dtype == bf
    torch.testing.assert_close(y, want, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(s1, s2, **TOL)
    args = _mamba2_decode_args(g, s1, len(slots), heads, hp, n, groups, A, D, db)
    args = (args[0], *(a.to(bf) if i in (1, 2, 4, 5) else a for i, a in enumerate(args) if i))
    out = K.selective_state_update(*args, slots)
    want = no_fallback["selective_state_update"](s2, *args[1:], slots)
    assert out.dtype == bf
    torch.testing.assert_close(out, want, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(s1, s2, **TOL)
    # Mamba-1 prefill with its gate
    d = 24
    xm, zm, dtm = (torch.randn(t, d, generator=g).to(bf) for _ in range(3))
    Bm, Cm = (torch.randn(t, n, generator=g).to(bf) for _ in range(2))
    Am = -torch.rand(d, n, generator=g) * 4
    m1, m2 = _pair(torch.randn(n_slots, d, n, generator=g))
    Dm, dbm = torch.randn(d, generator=g), torch.randn(d, generator=g).to(bf)  # mixed params
    tail = (qsl, slots, carried)
    y = K.selective_scan_varlen(xm, dtm, Am, Bm, Cm, Dm, zm, dbm, True, m1, *tail)
    want = no_fallback["selective_scan_varlen"](xm, dtm, Am, Bm, Cm, Dm, zm, dbm, True, m2, *tail)
    torch.testing.assert_close(y, want, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(m1, m2, **TOL)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lightning_decode_matches_reference(dtype, monkeypatch):
    """MiniMax's linear-attention decode step: the kernel against the reference (made to raise
    for the call under test), two steps over scattered slots, q/k/v as views of one projection."""
    from llmhal.ops import linear_attn_ops

    reference = linear_attn_ops.lightning_attn_decode

    def refuse(*args, **kwargs):
        raise AssertionError("the kernel fell back to the reference")

    g = torch.Generator().manual_seed(40)
    b, heads, d, slots = 3, 4, 16, torch.tensor([5, 0, 2], dtype=torch.int32)
    decay = torch.rand(heads, generator=g)
    mine, theirs = _pair(torch.randn(6, heads, d, d, generator=g))
    for _ in range(2):
        qkv = torch.randn(b, heads, 3 * d, generator=g).to(dtype)
        q, k, v = qkv[..., :d], qkv[..., d : 2 * d], qkv[..., 2 * d :]
        monkeypatch.setattr(linear_attn_ops, "lightning_attn_decode", refuse)
        out = K.lightning_attn_decode(q, k, v, decay, mine, slots)
        monkeypatch.setattr(linear_attn_ops, "lightning_attn_decode", reference)
        want = reference(q, k, v, decay, theirs, slots)
        assert out.dtype == dtype
        torch.testing.assert_close(out, want, atol=2e-2 if dtype != torch.float32 else 1e-4,
                                   rtol=1e-2 if dtype != torch.float32 else 1e-4)  # fmt: skip
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


# A bfloat16 state (mamba_ssm_cache_dtype): both sides update it in float32 and round once a call,
# so the states may differ by one bf16 step (2^-8 relative) where float32 sums differ in the last
# bit; the outputs are read from the unrounded state on both sides.
BF16_STATE_TOL = dict(atol=1e-3, rtol=8e-3)


@needs_kernel
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_bfloat16_state_matches_reference(seed, act, no_fallback):
    """Mamba-2 and Mamba-1 prefill (odd lengths, carried and fresh slots) then two decode steps on
    a bf16 SSM state, with float32 or bf16 activations: the kernel reads and writes the bf16 slots
    in place, as the reference does."""
    g = torch.Generator().manual_seed(50 + seed)
    bf, out_tol = torch.bfloat16, (TOL if act == torch.float32 else dict(atol=2e-2, rtol=1e-2))
    groups = (1, 2, 1)[seed]
    heads, hp, n = groups * (2 + seed), (4, 3, 7)[seed], (16, 5, 33)[seed]
    t, qsl, slots, carried, n_slots = _batch(g, 2 + seed, 9)
    x = torch.randn(t, heads, hp, generator=g).to(act)
    dt = torch.randn(t, heads, generator=g).to(act)
    B, C = (torch.randn(t, groups, n, generator=g).to(act) for _ in range(2))
    A = -torch.rand(heads, generator=g) * 3
    D, bias = torch.randn(heads, generator=g), torch.randn(heads, generator=g)
    mine, theirs = _pair(torch.randn(n_slots, heads, hp, n, generator=g).to(bf))
    lim, tail = (0.0, float("inf")), (qsl, slots, carried)
    out = K.ssd_chunk_scan_varlen(x, dt, A, B, C, 4, D, bias, True, lim, mine, *tail)
    want = no_fallback["ssd_chunk_scan_varlen"](
        x, dt, A, B, C, 4, D, bias, True, lim, theirs, *tail
    )
    assert mine.dtype == bf and out.dtype == act
    torch.testing.assert_close(out, want, **out_tol)
    torch.testing.assert_close(mine, theirs, **BF16_STATE_TOL)
    untouched = torch.ones(n_slots, dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(mine[untouched], theirs[untouched])  # other slots are not written
    for _ in range(2):
        args = _mamba2_decode_args(g, mine, len(slots), heads, hp, n, groups, A, D, bias)
        args = (args[0], *(a.to(act) if i in (1, 2, 4, 5) else a for i, a in enumerate(args) if i))
        out = K.selective_state_update(*args, slots)
        want = no_fallback["selective_state_update"](theirs, *args[1:], slots)
        torch.testing.assert_close(out, want, **out_tol)
        torch.testing.assert_close(mine, theirs, **BF16_STATE_TOL)
    # Mamba-1: A [d, n], a gate, then its decode (H = 1)
    d = 5 + 7 * seed
    xm, zm, dtm = (torch.randn(t, d, generator=g).to(act) for _ in range(3))
    Bm, Cm = (torch.randn(t, n, generator=g).to(act) for _ in range(2))
    Am = -torch.rand(d, n, generator=g) * 4
    m1, m2 = _pair(torch.randn(n_slots, d, n, generator=g).to(bf))
    y = K.selective_scan_varlen(xm, dtm, Am, Bm, Cm, None, zm, None, True, m1, *tail)
    want = no_fallback["selective_scan_varlen"](
        xm, dtm, Am, Bm, Cm, None, zm, None, True, m2, *tail
    )
    torch.testing.assert_close(y, want, **out_tol)
    torch.testing.assert_close(m1, m2, **BF16_STATE_TOL)
    b = len(slots)
    xs, dts = (torch.randn(b, 1, d, generator=g).to(act) for _ in range(2))
    Bs, Cs = (torch.randn(b, 1, n, generator=g).to(act) for _ in range(2))
    out, want = (
        update(st[:, None], xs, dts, Am[None], Bs, Cs, None, None, None, True, slots)
        for update, st in (
            (K.selective_state_update, m1),
            (no_fallback["selective_state_update"], m2),
        )
    )
    torch.testing.assert_close(out, want, **out_tol)
    torch.testing.assert_close(m1, m2, **BF16_STATE_TOL)


@needs_kernel
def test_bfloat16_prefill_state_is_rounded_once():
    """A long prefill on a bf16 state equals the same prefill on a float32 state rounded once at
    the end (the kernel keeps its tile in float32 across tokens), not one rounded every token."""
    g = torch.Generator().manual_seed(60)
    t, heads, hp, n = 57, 2, 3, 8
    x, dt = torch.randn(t, heads, hp, generator=g), torch.randn(t, heads, generator=g)
    B, C = (torch.randn(t, 1, n, generator=g) for _ in range(2))
    A, idx = -torch.rand(heads, generator=g), torch.tensor([0], dtype=torch.int32)
    qsl, init = torch.tensor([0, t], dtype=torch.int32), torch.tensor([False])
    wide, narrow = torch.zeros(1, heads, hp, n), torch.zeros(1, heads, hp, n, dtype=torch.bfloat16)
    lim = (0.0, float("inf"))
    y32 = K.ssd_chunk_scan_varlen(x, dt, A, B, C, 8, None, None, True, lim, wide, qsl, idx, init)
    y16 = K.ssd_chunk_scan_varlen(x, dt, A, B, C, 8, None, None, True, lim, narrow, qsl, idx, init)
    assert torch.equal(narrow, wide.bfloat16())
    assert torch.equal(y16, y32)
    # a decode step (rounded in vector registers): the float32 step on the widened state, rounded
    # by torch, exactly; a NaN stays a NaN
    narrow[0, 1, 2, 5] = float("nan")
    wide = narrow.float()
    args = _mamba2_decode_args(g, None, 1, heads, hp, n, 1, A, torch.ones(heads), torch.ones(heads))
    y16 = K.selective_state_update(narrow, *args[1:], idx)
    y32 = K.selective_state_update(wide, *args[1:], idx)
    exact = dict(rtol=0, atol=0, equal_nan=True)  # a NaN's payload bits are not compared
    torch.testing.assert_close(narrow, wide.bfloat16(), **exact)
    torch.testing.assert_close(y16, y32, rtol=1e-6, atol=1e-7, equal_nan=True)  # FMAs may differ


@needs_kernel
def test_lightning_decode_bfloat16_state(monkeypatch):
    """Lightning attention's decode step on a bf16 state (mamba_cache_dtype auto in a bf16
    model): updated where it lies, rounded as the reference rounds."""
    from llmhal.ops import linear_attn_ops

    reference = linear_attn_ops.lightning_attn_decode

    def refuse(*args, **kwargs):
        raise AssertionError("the kernel fell back to the reference")

    g = torch.Generator().manual_seed(41)
    b, heads, d, slots = 2, 3, 12, torch.tensor([3, 1], dtype=torch.int32)
    decay = torch.rand(heads, generator=g)
    mine, theirs = _pair(torch.randn(4, heads, d, d, generator=g).bfloat16())
    for _ in range(2):
        q, k, v = (torch.randn(b, heads, d, generator=g).bfloat16() for _ in range(3))
        monkeypatch.setattr(linear_attn_ops, "lightning_attn_decode", refuse)
        out = K.lightning_attn_decode(q, k, v, decay, mine, slots)
        monkeypatch.setattr(linear_attn_ops, "lightning_attn_decode", reference)
        want = reference(q, k, v, decay, theirs, slots)
        torch.testing.assert_close(out, want, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(mine, theirs, **BF16_STATE_TOL)
