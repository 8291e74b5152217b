"""``fused_moe``: routing and the experts' weighted sum against HF transformers' own MoE blocks, the
grouped top-k of DeepSeek-V3 against its router, int8 experts against their dequantized weights,
only chosen experts touched, and dispatch through the op registry."""

from __future__ import annotations

import pytest
import torch
import transformers

from llmhal.ops import fused_moe as moe
from llmhal.ops.registry import _reset_for_tests, get_op, op_implementation

H, INTER, E = 48, 40, 8


def _hf_block(arch: str, **kw):
    """An HF sparse MoE block with random weights (router, fused experts)."""
    torch.manual_seed(0)
    if arch == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = transformers.MixtralConfig(
            hidden_size=H, intermediate_size=INTER, num_local_experts=E, **kw
        )
        block = MixtralSparseMoeBlock(cfg)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg = transformers.Qwen3MoeConfig(
            hidden_size=H, moe_intermediate_size=INTER, num_experts=E, **kw
        )
        block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return block.eval()


@pytest.mark.parametrize(
    "arch,kw,renormalize",
    [
        ("mixtral", {"num_experts_per_tok": 2}, True),
        ("qwen3", {"num_experts_per_tok": 3, "norm_topk_prob": False}, False),
        ("qwen3", {"num_experts_per_tok": 1, "norm_topk_prob": True}, True),
    ],
)
@pytest.mark.parametrize("tokens", [1, 3, 37])
def test_matches_hf_sparse_moe_blocks(arch, kw, renormalize, tokens):
    block = _hf_block(arch, **kw)
    x = torch.randn(tokens, H)
    with torch.no_grad():
        ref = block(x[None])[0]
        logits = torch.nn.functional.linear(x, block.gate.weight)
    out = moe.fused_moe(
        x,
        block.experts.gate_up_proj.data,
        block.experts.down_proj.data,
        logits,
        kw["num_experts_per_tok"],
        renormalize=renormalize,
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_bf16_close_to_hf():
    block = _hf_block("mixtral", num_experts_per_tok=2).to(torch.bfloat16)
    x = torch.randn(9, H, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = block(x[None])[0]
        logits = torch.nn.functional.linear(x, block.gate.weight)
    out = moe.fused_moe(x, block.experts.gate_up_proj, block.experts.down_proj, logits, 2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("renorm,scale", [(True, 2.5), (False, 1.0)])
def test_grouped_topk_with_bias_matches_deepseek_v3_router(renorm, scale):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(
        hidden_size=H,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=renorm,
        routed_scaling_factor=scale,
    )
    torch.manual_seed(3)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn_like(router.weight))
        router.e_score_correction_bias.copy_(torch.randn(16) * 0.5)
    x = torch.randn(21, H)
    with torch.no_grad():
        logits, ref_w, ref_ids = router(x)
    w, ids = moe.select_experts(
        logits,
        4,
        renormalize=renorm,
        scoring_func="sigmoid",
        num_expert_group=4,
        topk_group=2,
        e_score_correction_bias=router.e_score_correction_bias,
        routed_scaling_factor=scale,
    )
    # Same experts per token (HF's order is unsorted), same weight for each.
    ref = torch.zeros(21, 16).scatter_(1, ref_ids, ref_w)
    got = torch.zeros(21, 16).scatter_(1, ids, w)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    # The bias moved some choices away from the plain top-k of the scores.
    plain = moe.select_experts(logits, 4, scoring_func="sigmoid")[1]
    assert not torch.equal(plain.sort(-1)[0], ids.sort(-1)[0])


def test_grouped_topk_without_bias_keeps_only_the_best_groups():
    """DeepSeek-V2's group-limited greedy: a group scores its best expert; experts outside the
    chosen groups are never picked even when their score is higher than a chosen one's."""
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0, 4.0, 4.0, 3.9, 3.8]])
    w, ids = moe.select_experts(logits, 2, renormalize=False, num_expert_group=2, topk_group=1)
    assert ids[0].tolist() == [0, 1]
    scores = logits.softmax(-1)
    torch.testing.assert_close(w[0], scores[0, :2])


class _RecordingExperts:
    """Stands in for a stacked weight and records which experts were read."""

    def __init__(self, w: torch.Tensor, seen: set[int]) -> None:
        self.w, self.seen, self.shape = w, seen, w.shape

    def __getitem__(self, e: int) -> torch.Tensor:
        self.seen.add(int(e))
        return self.w[e]


@pytest.mark.parametrize("tokens", [1, 4])
def test_only_chosen_experts_are_computed(tokens):
    torch.manual_seed(5)
    w13, w2 = torch.randn(E, 2 * INTER, H), torch.randn(E, H, INTER)
    x, logits = torch.randn(tokens, H), torch.randn(tokens, E)
    seen13: set[int] = set()
    seen2: set[int] = set()
    out = moe.fused_moe(x, _RecordingExperts(w13, seen13), _RecordingExperts(w2, seen2), logits, 2)
    chosen = set(logits.topk(2, dim=-1)[1].flatten().tolist())
    assert seen13 == seen2 == chosen and len(chosen) < E
    torch.testing.assert_close(out, moe.fused_moe(x, w13, w2, logits, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_experts_match_their_dequantized_weights(dtype):
    torch.manual_seed(6)
    q13 = torch.randint(-127, 128, (E, 2 * INTER, H), dtype=torch.int8)
    q2 = torch.randint(-127, 128, (E, H, INTER), dtype=torch.int8)
    s13, s2 = torch.rand(E, 2 * INTER) * 1e-3, torch.rand(E, H) * 1e-3
    x, logits = torch.randn(6, H, dtype=dtype), torch.randn(6, E)
    out = moe.fused_moe(x, q13, q2, logits, 2, w13_scale=s13, w2_scale=s2)
    deq13 = (q13.float() * s13[..., None]).to(dtype)
    deq2 = (q2.float() * s2[..., None]).to(dtype)
    ref = moe.fused_moe(x, deq13, deq2, logits, 2)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_bad_routing_arguments_name_the_choices():
    logits = torch.randn(2, 6)
    with pytest.raises(ValueError, match="softmax, sigmoid"):
        moe.select_experts(logits, 2, scoring_func="relu")
    with pytest.raises(ValueError, match="num_expert_group=4"):
        moe.select_experts(logits, 2, num_expert_group=4, topk_group=1)
    with pytest.raises(ValueError, match="silu, gelu"):
        moe.gated_activation("relu")


def test_platform_kernel_or_the_reference(monkeypatch):
    """The active platform's kernel is used and agrees with the reference; a platform that brings
    no fused_moe gets core's reference."""
    from llmhal.platforms import get_current_platform
    from llmhal.testing.contribution_checks import check_op_kernel

    platform = get_current_platform()
    _reset_for_tests()
    try:
        impl = op_implementation("fused_moe")
        if "fused_moe" in platform.op_kernels:
            assert impl.source == platform.name
            finding = check_op_kernel(platform, "fused_moe")
            assert not finding.problems and not finding.skipped, finding
            monkeypatch.delitem(type(platform).op_kernels, "fused_moe")
            _reset_for_tests()
        impl = op_implementation("fused_moe")
        assert (impl.source, impl.implementation) == ("core", "llmhal.ops.fused_moe:fused_moe")
        assert get_op("fused_moe") is moe.fused_moe
    finally:
        _reset_for_tests()


def test_shared_output_is_added_gated_or_not():
    """``shared_output`` (DeepSeek's shared experts) is added to the routed sum, scaled by
    ``sigmoid(shared_gate)`` when given (Qwen2-MoE's gated shared expert)."""
    torch.manual_seed(7)
    w13, w2 = torch.randn(E, 2 * INTER, H), torch.randn(E, H, INTER)
    x, logits = torch.randn(3, H), torch.randn(3, E)
    shared, gate = torch.randn(3, H), torch.randn(3, 1)
    routed = moe.fused_moe(x, w13, w2, logits, 2)
    assert torch.equal(moe.fused_moe(x, w13, w2, logits, 2, shared_output=shared), routed + shared)
    gated = moe.fused_moe(x, w13, w2, logits, 2, shared_output=shared, shared_gate=gate)
    assert torch.equal(gated, routed + shared * torch.sigmoid(gate))


def test_router_logits_widen_the_activations_to_the_router_dtype():
    x, w = torch.randn(4, H).bfloat16(), torch.randn(E, H)
    got = moe.router_logits(x, w)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.nn.functional.linear(x.float(), w))
