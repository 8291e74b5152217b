"""The CPU ``fused_moe`` kernel against core's reference, unquantized and with int8 experts."""

from __future__ import annotations

import pytest
import torch

from llmhal.ops import fused_moe as core_moe
from llmhal_cpu import moe

E, H, INTER = 6, 64, 48
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("tokens", [1, 9])
def test_matches_the_reference(dtype, int8, tokens):
    torch.manual_seed(0)
    x, logits = torch.randn(tokens, H).to(dtype), torch.randn(tokens, E)
    if int8:
        w13 = torch.randint(-127, 128, (E, 2 * INTER, H), dtype=torch.int8)
        w2 = torch.randint(-127, 128, (E, H, INTER), dtype=torch.int8)
        scales = {"w13_scale": torch.rand(E, 2 * INTER) * 1e-3, "w2_scale": torch.rand(E, H) * 1e-2}
    else:
        w13, w2 = (
            (torch.randn(E, 2 * INTER, H) * 0.1).to(dtype),
            (torch.randn(E, H, INTER) * 0.1).to(dtype),
        )
        scales = {}
    got = moe.fused_moe(x, w13, w2, logits, 2, renormalize=False, **scales)
    ref = core_moe.fused_moe(x, w13, w2, logits, 2, renormalize=False, **scales)
    assert got.dtype == dtype and got.shape == ref.shape
    scale = ref.float().abs().max().clamp_min(1.0)
    assert float((got.float() - ref.float()).abs().max() / scale) < TOL[dtype]


# The native kernel (kernels/moe_experts.cpp) against core's grouped path in float64: sizes that
# leave vector tails (h=70, inter=37), an expert chosen by more tokens than one block of 8.
KH, KI, KE = 70, 37, 5


def _float64_reference(x, weights, ids, w13, w2, s13=None, s2=None):
    w13, w2 = w13.double(), w2.double()
    if s13 is not None:
        w13, w2 = w13 * s13.double()[..., None], w2 * s2.double()[..., None]
    act = core_moe.gated_activation("silu")
    return core_moe.grouped_experts(x.double(), w13, w2, weights.double(), ids, act_and_mul=act)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_native_kernel_matches_float64(wdtype, xdtype):
    from llmhal_cpu.kernels import moe_experts

    if moe_experts.LIBRARY.get() is None:
        pytest.skip(f"native kernel unavailable: {moe_experts.LIBRARY.status}")
    g = torch.Generator().manual_seed(1)
    tokens, k = 11, 3
    x = torch.randn(tokens, KH, generator=g).to(xdtype)
    weights, ids = core_moe.select_experts(torch.randn(tokens, KE, generator=g), k)
    ids[:, 0] = 2  # expert 2 gets all 11 tokens: two blocks
    scales = [None, None]
    if wdtype == torch.int8:
        w13 = torch.randint(-127, 128, (KE, 2 * KI, KH), dtype=torch.int8, generator=g)
        w2 = torch.randint(-127, 128, (KE, KH, KI), dtype=torch.int8, generator=g)
        scales = [
            torch.rand(KE, 2 * KI, generator=g) * 1e-3,
            torch.rand(KE, KH, generator=g) * 1e-2,
        ]
    else:
        w13 = (torch.randn(KE, 2 * KI, KH, generator=g) * 0.2).to(wdtype)
        w2 = (torch.randn(KE, KH, KI, generator=g) * 0.2).to(wdtype)
    got = moe_experts.moe_experts(x, weights, ids, w13, w2, *scales)
    ref = _float64_reference(x, weights, ids, w13, w2, *scales)
    assert got is not None and got.dtype == torch.float32
    # float32 accumulation of float32 products: only summation order differs from float64;
    # bf16 activations with bf16 or int8 weights may run on bf16 dots, which round
    # silu(gate) * up to bf16
    bf16_dots = xdtype == torch.bfloat16 and wdtype in (torch.bfloat16, torch.int8)
    tol = 2**-7 if bf16_dots else 1e-5
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < tol


def test_native_kernel_threads_split_rows_without_changing_the_result():
    from llmhal_cpu.kernels import moe_experts

    if moe_experts.LIBRARY.get() is None:
        pytest.skip(f"native kernel unavailable: {moe_experts.LIBRARY.status}")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 256, generator=g)
    w13, w2 = torch.randn(3, 256, 256, generator=g), torch.randn(3, 256, 128, generator=g)
    weights, ids = core_moe.select_experts(torch.randn(4, 3, generator=g), 2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = moe_experts.moe_experts(x, weights, ids, w13, w2)
        torch.set_num_threads(2)  # 256 * 256 rows x cols: above the kernel's parallel threshold
        two = moe_experts.moe_experts(x, weights, ids, w13, w2)
    finally:
        torch.set_num_threads(before)
    assert one is not None and torch.equal(one, two)  # each row's dot is computed the same way


def test_native_kernel_rejects_an_expert_id_out_of_range():
    from llmhal_cpu.kernels import moe_experts

    if moe_experts.LIBRARY.get() is None:
        pytest.skip(f"native kernel unavailable: {moe_experts.LIBRARY.status}")
    w13, w2 = torch.zeros(2, 8, 16), torch.zeros(2, 16, 4)
    ids = torch.tensor([[0, 2]])
    with pytest.raises(IndexError, match="outside 0..1"):
        moe_experts.moe_experts(torch.zeros(1, 16), torch.ones(1, 2), ids, w13, w2)


def test_native_kernel_refuses_a_routing_that_does_not_fit_the_hidden_rows():
    """ids and weights are read T * k at a time, T from hidden: other shapes were read past their
    ends (a 1-row routing for 8 rows raised "an expert id is outside ..." from garbage)."""
    from llmhal_cpu.kernels import moe_experts

    w13, w2 = torch.zeros(4, 8, 16), torch.zeros(4, 16, 4)
    x, ids, weights = torch.zeros(8, 16), torch.zeros(8, 2, dtype=torch.long), torch.ones(8, 2)
    for bad_ids, bad_weights in [
        (ids[:1], weights[:1]),  # fewer rows than hidden
        (ids, weights[:, :1]),  # k differs
        (ids.view(16), weights.view(16)),  # not 2-D
        (ids.view(8, 2, 1), weights.view(8, 2, 1)),
    ]:
        with pytest.raises(ValueError, match=r"\[T, k\], T being hidden's rows \(hidden \(8, 16\)"):
            moe_experts.moe_experts(x, bad_weights, bad_ids, w13, w2)
    if moe_experts.LIBRARY.get() is not None:
        assert moe_experts.moe_experts(x, weights, ids, w13, w2).shape == (8, 16)
    # Experts that are not stacked 3-D tensors: declined (None), not a bare unpacking error.
    assert moe_experts.moe_experts(x, weights, ids, w13.view(32, 16), w2) is None


def test_kernel_for_decode_sizes_torch_for_prefill(monkeypatch):
    """fused_moe takes the kernel while the pairs per expert are few, core's GEMMs beyond."""
    from llmhal_cpu.kernels import moe_experts

    calls = []
    real = moe_experts.moe_layer
    monkeypatch.setattr(
        moe_experts, "moe_layer", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw)
    )
    w13, w2 = torch.randn(4, 16, 32) * 0.1, torch.randn(4, 32, 8) * 0.1
    limit = moe.KERNEL_ROWS_PER_EXPERT * 4 // 2  # tokens at top-2
    for tokens in (1, limit, limit + 1):
        x, logits = torch.randn(tokens, 32), torch.randn(tokens, 4)
        got = moe.fused_moe(x, w13, w2, logits, 2)
        ref = core_moe.fused_moe(x, w13, w2, logits, 2)
        assert float((got - ref).abs().max()) < 1e-5
    assert calls == [1, limit]
    calls.clear()
    moe.fused_moe(torch.randn(2, 32), w13, w2, torch.randn(2, 4), 2, activation="gelu")
    assert calls == []  # the kernel computes silu only


def test_kernel_switch_turns_it_off_and_doctor_says_so(monkeypatch):
    from llmhal_cpu.kernels import moe_experts

    w13, w2 = torch.randn(2, 8, 16), torch.randn(2, 16, 4)
    weights, ids = torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long)
    monkeypatch.setenv("LLMHAL_CPU_MOE_KERNEL", "0")
    assert moe_experts.moe_experts(torch.randn(1, 16), weights, ids, w13, w2) is None
    assert moe.fused_moe.status() == "torch (LLMHAL_CPU_MOE_KERNEL=0)"
    monkeypatch.delenv("LLMHAL_CPU_MOE_KERNEL")
    if moe_experts.LIBRARY.get() is not None:
        assert moe.fused_moe.status() == "native moe_experts"
        assert moe_experts.moe_experts(torch.randn(1, 16), weights, ids, w13, w2) is not None


# Routing: the kernel chooses the experts core's select_experts (torch) chooses, in the same order.
# Integer logits make ties everywhere (softmax and sigmoid of equal logits are equal in any
# implementation), which torch.topk orders by its own unstable algorithm; random ones test the rest.
ROUTINGS = {
    "softmax": {},
    "softmax, not renormalized": {"renormalize": False},
    "sigmoid": {"scoring_func": "sigmoid"},
    "grouped": {"num_expert_group": 4, "topk_group": 2},
    "v3": {"scoring_func": "sigmoid", "num_expert_group": 4, "topk_group": 2, "bias": True,
           "routed_scaling_factor": 2.5},
}  # fmt: skip


def _routing(name: str, experts: int, g: torch.Generator) -> dict:
    opts = dict(ROUTINGS[name])
    if opts.pop("bias", False):  # a bias of 0 or 0.5: ties survive it
        opts["e_score_correction_bias"] = torch.randint(0, 2, (experts,), generator=g) * 0.5
    return opts


def _logits(tokens: int, experts: int, g: torch.Generator, ties: bool) -> torch.Tensor:
    if ties:
        return torch.randint(-2, 3, (tokens, experts), generator=g).float()
    return torch.randn(tokens, experts, generator=g)


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("experts", [8, 16, 64, 256])
def test_native_routing_chooses_as_torch_does_ties_included(name, experts):
    from llmhal_cpu.kernels import moe_experts

    if moe_experts.LIBRARY.get() is None:
        pytest.skip(f"native kernel unavailable: {moe_experts.LIBRARY.status}")
    g = torch.Generator().manual_seed(experts)
    for k in (1, 2, 4, 8):  # 256 experts at k 1..4: torch.topk's partial_sort branch
        for trial in range(6):
            logits, opts = _logits(7, experts, g, ties=trial % 2 == 0), _routing(name, experts, g)
            want_w, want_ids = core_moe.select_experts(logits, k, **opts)
            got = moe_experts.route(logits, k, **opts)
            assert got is not None
            assert torch.equal(got[1], want_ids), (k, trial, logits, got[1], want_ids)
            torch.testing.assert_close(got[0], want_w, rtol=1e-6, atol=1e-7)
            # bf16 logits are read as they are (the router's output in a bf16 model)
            bf = logits.bfloat16()
            assert torch.equal(moe_experts.route(bf, k, **opts)[1],
                               core_moe.select_experts(bf, k, **opts)[1])  # fmt: skip


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_whole_layer_in_one_call_matches_the_reference(name, dtype):
    """moe_layer (routing and experts) against core's fused_moe, in the activations' dtype."""
    from llmhal_cpu.kernels import moe_experts

    if moe_experts.LIBRARY.get() is None:
        pytest.skip(f"native kernel unavailable: {moe_experts.LIBRARY.status}")
    g = torch.Generator().manual_seed(3)
    experts = 8
    x = torch.randn(6, KH, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * KI, KH, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(experts, KH, KI, generator=g) * 0.2).to(dtype)
    logits, opts = _logits(6, experts, g, ties=True).to(dtype), _routing(name, experts, g)
    got = moe.fused_moe(x, w13, w2, logits, 2, **opts)
    weights, ids = core_moe.select_experts(logits, 2, **opts)
    ref = _float64_reference(x, weights, ids, w13, w2)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's rounding
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < tol


def test_a_decode_sized_moe_layer_records_as_a_step_graph():
    """The CPU fused_moe for decode sizes makes native calls only: it records, and a replay on new
    values equals the eager call on them."""
    from llmhal_cpu import step_graph
    from llmhal_cpu.kernels import moe_experts

    if moe_experts.LIBRARY.get() is None or step_graph.LIBRARY.get() is None:
        pytest.skip("native kernels unavailable")
    g = torch.Generator().manual_seed(4)
    x, logits = torch.randn(4, KH, generator=g).bfloat16(), torch.randn(4, 16, generator=g)
    w13 = (torch.randn(16, 2 * KI, KH, generator=g) * 0.2).bfloat16()
    w2 = (torch.randn(16, KH, KI, generator=g) * 0.2).bfloat16()
    opts = _routing("v3", 16, g)
    out, graph, reason = step_graph.capture(lambda: moe.fused_moe(x, w13, w2, logits, 4, **opts))
    assert graph is not None, reason
    x.copy_(torch.randn(4, KH, generator=g))
    logits.copy_(torch.randn(4, 16, generator=g))
    graph.replay()
    assert torch.equal(out, moe.fused_moe(x, w13, w2, logits, 4, **opts))


def test_large_bf16_experts_stay_within_bf16_rounding():
    """Mixtral-sized bf16 experts with bf16 activations (AVX512-BF16 dots where the host has them:
    silu(gate) * up rounded to bf16 before the down rows, as torch's bf16 path rounds it; the
    widened path elsewhere) stay within bf16 rounding of float64, tails included."""
    from llmhal_cpu.kernels import moe_experts

    if moe_experts.LIBRARY.get() is None:
        pytest.skip(f"native kernel unavailable: {moe_experts.LIBRARY.status}")
    g = torch.Generator().manual_seed(5)
    h, inter, experts = 1024, 1040, 3  # 1040: a tail after the last 32 bf16 pairs
    x = torch.randn(5, h, generator=g).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, h, generator=g) * 0.03).bfloat16()
    w2 = (torch.randn(experts, h, inter, generator=g) * 0.03).bfloat16()
    weights, ids = core_moe.select_experts(torch.randn(5, experts, generator=g), 2)
    got = moe_experts.moe_experts(x, weights, ids, w13, w2)
    ref = _float64_reference(x, weights, ids, w13, w2)
    assert got is not None
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 2**-7


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.int8])
def test_busy_large_experts_prefetch_within_bounds(wdtype):
    """8 tokens on the same two Mixtral-sized experts, the last ones of the stacked tensors: their
    rows are prefetched 8 KiB ahead (moe_experts.cpp: bf16 blocks of 3 or more tokens, large
    widened experts always), past the end of the weights at the last rows (a prefetch cannot
    fault), with the same sums as the float64 reference within bf16 rounding."""
    from llmhal_cpu.kernels import moe_experts

    if moe_experts.LIBRARY.get() is None:
        pytest.skip(f"native kernel unavailable: {moe_experts.LIBRARY.status}")
    g = torch.Generator().manual_seed(9)
    h, inter, experts = 1024, 1024, 3
    x = torch.randn(8, h, generator=g).bfloat16()
    w13 = torch.randn(experts, 2 * inter, h, generator=g) * 0.03
    w2 = torch.randn(experts, h, inter, generator=g) * 0.03
    s13 = s2 = None
    if wdtype == torch.int8:  # experts_int8's layout: one float32 scale per output row
        s13, s2 = w13.abs().amax(-1) / 127, w2.abs().amax(-1) / 127
        w13 = (w13 / s13[..., None]).round().to(torch.int8)
        w2 = (w2 / s2[..., None]).round().to(torch.int8)
    else:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    ids = torch.tensor([[2, 1]] * 8)
    weights = torch.rand(8, 2, generator=g)
    got = moe_experts.moe_experts(x, weights, ids, w13, w2, s13, s2)
    ref = _float64_reference(x, weights, ids, w13, w2, s13, s2)
    assert got is not None
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 2**-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
def test_shared_experts_are_added_in_the_same_call(dtype, gated):
    """The CPU op adds ``shared_output`` (times ``sigmoid(shared_gate)``) inside the native call,
    rounding the sum once; core's reference adds it in torch."""
    from llmhal_cpu import step_graph
    from llmhal_cpu.kernels import moe_experts

    if moe_experts.LIBRARY.get() is None:
        pytest.skip(f"native kernel unavailable: {moe_experts.LIBRARY.status}")
    g = torch.Generator().manual_seed(6)
    x, logits = torch.randn(3, KH, generator=g).to(dtype), torch.randn(3, KE, generator=g)
    w13 = (torch.randn(KE, 2 * KI, KH, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(KE, KH, KI, generator=g) * 0.2).to(dtype)
    shared = torch.randn(3, KH, generator=g).to(dtype)
    gate = torch.randn(3, 1, generator=g).to(dtype) if gated else None
    kw = {"shared_output": shared, "shared_gate": gate}
    got, graph, reason = step_graph.capture(lambda: moe.fused_moe(x, w13, w2, logits, 2, **kw))
    assert graph is not None, reason  # one native call, the shared part included
    weights, ids = core_moe.select_experts(logits, 2)
    ref = _float64_reference(x, weights, ids, w13, w2) + shared.double() * (
        1.0 if gate is None else torch.sigmoid(gate.double())
    )
    tol = 1e-5 if dtype == torch.float32 else 2**-8  # bf16: one rounding of the sum
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < tol


def test_a_float32_router_reads_bf16_activations_natively():
    """The ``router_logits`` op (DeepSeek's float32 gate in a bf16 model): decode rows in one
    recordable native call, within float32 summation order of ``F.linear(x.float(), w)``."""
    from llmhal_cpu import step_graph

    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(4, KH, generator=g).bfloat16(), torch.randn(KE, KH, generator=g)
    got, graph, reason = step_graph.capture(lambda: moe.router_logits(x, w))
    want = torch.nn.functional.linear(x.float(), w)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if step_graph.LIBRARY.get() is not None and moe.rows_linear.LIBRARY.get() is not None:
        assert graph is not None, reason
