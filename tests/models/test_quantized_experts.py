"""GPTQ, AWQ and compressed-tensors experts (llmhal.quantization.expert_linears): tiny random Mixtral
and Qwen3-MoE checkpoints quantized in the published layouts (the packers of the dense tests),
through ``LLM``, against the same models with the dequantized weights run unquantized: greedy tokens
identical, top-5 log-probabilities within the stated tolerance. Plus the checkpoint's "which layers"
rules for experts and the router, and the ``fused_moe`` op's per-expert kernel form."""

from __future__ import annotations

import pytest
import torch

from llmhal.testing.model_parity import save_tiny_model, tiny_config
from llmhal.testing.quant_models import (
    EXPERT_SUFFIXES,
    LINEAR_SUFFIXES,
    assert_greedy_parity,
    awq_rtn,
    write_pair,
)
from llmhal.testing.tiny_models import make_tokenizer
from tests.quantization.test_gptq import gptq_rtn

SUFFIXES = LINEAR_SUFFIXES + EXPERT_SUFFIXES
GROUP = 32
# Parity runs core's exact quant_linear kernel (the point is the experts' wiring); the platform's
# kernel is checked on its own below with a tolerance for its int16 activations.
LOGPROB_ATOL = 1e-4
PLATFORM_KERNEL_ATOL = 2e-3


@pytest.fixture(autouse=True)
def exact_kernel(request):
    from llmhal.testing.quant_layers import native_quant_kernel

    if "platform_kernel" in request.node.name:
        yield
        return
    with native_quant_kernel():
        yield


def _save(folder, arch: str, **extra):
    cfg = tiny_config(
        arch,
        vocab_size=384,  # the prompts of llmhal.testing.quant_models use ids up to 300
        num_hidden_layers=2,
        num_experts_per_tok=2,
        initializer_range=0.1,
        **extra,
    )
    save_tiny_model(cfg, folder)
    make_tokenizer(cfg.vocab_size).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("mixtral"), "MixtralForCausalLM", num_local_experts=4)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return _save(
        tmp_path_factory.mktemp("qwen3moe"),
        "Qwen3MoeForCausalLM",
        num_experts=4,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        head_dim=16,
    )


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """With Qwen2-MoE's shared expert (a dense MLP, quantized) and its sigmoid gate (a router,
    kept float)."""
    return _save(
        tmp_path_factory.mktemp("qwen2moe"),
        "Qwen2MoeForCausalLM",
        num_experts=4,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    )


def _gptq(sym: bool, fmt: str, act_order: bool):
    def quantize(name, w):
        return gptq_rtn(w, GROUP, sym=sym, fmt=fmt, act_order=act_order, seed=len(name))

    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order,
            "sym": sym, "checkpoint_format": fmt}  # fmt: skip
    return quantize, qcfg


def _expert_method(report_or_llm):
    from llmhal.layers.fused_moe import FusedMoE

    model = report_or_llm.engine.runner.model
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize(
    ("model", "sym", "fmt", "act_order"),
    [
        ("mixtral", True, "gptq", False),
        ("qwen3_moe", False, "gptq_v2", True),
        ("qwen2_moe", True, "gptq_v2", False),
    ],
)
def test_gptq_experts_match_the_dequantized_model(request, tmp_path, model, sym, fmt, act_order):
    quantize, qcfg = _gptq(sym, fmt, act_order)
    quant, ref = write_pair(
        tmp_path, quantize, qcfg, base=request.getfixturevalue(model), suffixes=SUFFIXES
    )
    q_report, ref_report = assert_greedy_parity(quant, ref, logprob_atol=LOGPROB_ATOL)
    assert q_report.quantization == "gptq"
    # 4-bit groups hold the experts and the attention in about a seventh of fp32's bytes.
    assert q_report.weight_bytes < 0.6 * ref_report.weight_bytes


def test_awq_experts_match_the_dequantized_model(qwen3_moe, tmp_path):
    qcfg = {"quant_method": "awq", "w_bit": 4, "q_group_size": GROUP, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": ["gate"]}  # fmt: skip
    quant, ref = write_pair(
        tmp_path, lambda name, w: awq_rtn(w, GROUP), qcfg, base=qwen3_moe, suffixes=SUFFIXES
    )
    q_report, ref_report = assert_greedy_parity(quant, ref, logprob_atol=LOGPROB_ATOL)
    assert q_report.quantization == "awq"
    assert q_report.weight_bytes < 0.6 * ref_report.weight_bytes


def test_compressed_tensors_w4a16_experts_match_the_library(mixtral, tmp_path):
    pytest.importorskip("compressed_tensors")
    from tests.quantization.test_compressed_tensors import make_checkpoint, quantize_linear

    # W4A16 with groups of 32 (the preset's 128 is wider than the tiny experts), asymmetric.
    scheme = {"weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                          "group_size": GROUP}}  # fmt: skip
    config, _state, _ref = make_checkpoint(scheme)
    quant, ref = write_pair(
        tmp_path,
        lambda name, w: quantize_linear(w, scheme),
        config,
        base=mixtral,
        suffixes=SUFFIXES,
    )
    q_report, ref_report = assert_greedy_parity(quant, ref, logprob_atol=LOGPROB_ATOL)
    assert q_report.quantization == "compressed-tensors"
    assert q_report.weight_bytes < 0.6 * ref_report.weight_bytes


def test_platform_kernel_runs_the_experts(mixtral, tmp_path):
    """Symmetric GPTQ experts on the platform's quant_linear (the CPU's integer kernel): no expert
    is dequantized; greedy tokens still equal the dequantized model's."""
    from llmhal import LLM
    from llmhal.layers.fused_moe import FusedMoE

    quant, ref = write_pair(tmp_path, *_gptq(True, "gptq", False), base=mixtral, suffixes=SUFFIXES)
    assert_greedy_parity(quant, ref, logprob_atol=PLATFORM_KERNEL_ATOL)
    model = LLM(str(quant), dtype="float32", kv_cache_memory_bytes=4 << 20).engine.runner.model
    layer = next(m for m in model.modules() if isinstance(m, FusedMoE))
    kernels = {type(k).__name__ for x in layer.expert_linears for k, _ in x.down_proj.quant_kernels}
    assert "DenseKernel" not in kernels, kernels


def test_rules_leave_some_experts_and_all_routers_unquantized(mixtral, tmp_path):
    """GPTQModel's ``dynamic`` excludes expert 1 of every layer, written in the checkpoint's own
    (Mixtral) spelling; the routers are not in any exclusion list and stay float all the same."""
    from llmhal import LLM
    from llmhal.layers.fused_moe import FusedMoE, RouterLinear
    from llmhal.quantization.unquantized import UnquantizedLinearMethod

    excluded = r".*block_sparse_moe\.experts\.1\..*"
    quantize, qcfg = _gptq(True, "gptq", False)
    qcfg["dynamic"] = {f"-:{excluded}": {}}

    def partly(name, w):
        if ".experts.1." in name:
            return {"weight": w}, w
        return quantize(name, w)

    quant, ref = write_pair(tmp_path, partly, qcfg, base=mixtral, suffixes=SUFFIXES)
    assert_greedy_parity(quant, ref, logprob_atol=LOGPROB_ATOL)
    llm = LLM(str(quant), dtype="float32", kv_cache_memory_bytes=4 << 20)
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    routers = [m for m in model.modules() if isinstance(m, RouterLinear)]
    assert layers and len(routers) == len(layers)
    assert all(isinstance(r.quant_method, UnquantizedLinearMethod) for r in routers)
    for layer in layers:
        kinds = [type(x.gate_up_proj.quant_method).__name__ for x in layer.expert_linears]
        assert kinds == ["GPTQLinearMethod", "UnquantizedLinearMethod"] + ["GPTQLinearMethod"] * 2
        assert "gptq experts" in layer.quant_method.describe(layer)


def test_experts_the_rules_skip_stay_stacked_and_unquantized(qwen3_moe, tmp_path):
    """AWQ's modules_to_not_convert naming the experts: attention quantized, experts float and
    stacked (the unquantized fused_moe path, not per-expert layers)."""
    from llmhal import LLM
    from llmhal.layers.fused_moe import FusedMoE, UnquantizedFusedMoEMethod

    qcfg = {"quant_method": "awq", "w_bit": 4, "q_group_size": GROUP, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": ["experts"]}  # fmt: skip
    quant, ref = write_pair(
        tmp_path, lambda name, w: awq_rtn(w, GROUP), qcfg, base=qwen3_moe,
        suffixes=tuple(s for s in LINEAR_SUFFIXES if "_proj" in s and "gate" not in s
                       and "up_" not in s and "down" not in s),
    )  # fmt: skip
    assert_greedy_parity(quant, ref, logprob_atol=LOGPROB_ATOL)
    llm = LLM(str(quant), dtype="float32", kv_cache_memory_bytes=4 << 20)
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(isinstance(m.quant_method, UnquantizedFusedMoEMethod) for m in layers)


def test_an_expert_tensor_the_method_does_not_read_is_named(qwen3_moe, tmp_path):
    from llmhal import LLM
    from llmhal.layers.weights import WeightLoadError

    quantize, qcfg = _gptq(True, "gptq", False)

    def with_stray(name, w):
        tensors, deq = quantize(name, w)
        if name.endswith("layers.1.mlp.experts.2.down_proj.weight"):
            tensors["weight_scale"] = torch.ones(1)
        return tensors, deq

    quant, _ref = write_pair(tmp_path, with_stray, qcfg, base=qwen3_moe, suffixes=SUFFIXES)
    with pytest.raises(WeightLoadError) as err:
        LLM(str(quant), dtype="float32", kv_cache_memory_bytes=4 << 20)
    msg = str(err.value)
    assert "experts.2.down_proj.weight_scale" in msg and "'weight_scale'" in msg
    assert "qweight" in msg  # what the expert's layer does read


def test_fused_moe_runs_expert_kernels_like_stacked_weights():
    from llmhal.ops.expert_kernels import ExpertKernels
    from llmhal.ops.fused_moe import fused_moe

    torch.manual_seed(0)
    e, h, i, t = 5, 16, 24, 7
    w13, w2 = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    x, logits = torch.randn(t, h), torch.randn(t, e)
    calls: list[int] = []

    def kernel(w, idx):
        def run(rows):
            calls.append(idx)
            return rows @ w.T

        run.weight_bytes = lambda: w.numel() * w.element_size()
        return run

    k13 = ExpertKernels([kernel(w13[n], n) for n in range(e)])
    k2 = ExpertKernels([kernel(w2[n], n) for n in range(e)])
    want = fused_moe(x, w13, w2, logits, 2)
    got = fused_moe(x, k13, k2, logits, 2)
    torch.testing.assert_close(got, want)
    chosen = set(logits.topk(2, dim=-1)[1].reshape(-1).tolist())
    assert set(calls) == chosen  # only chosen experts ran
    assert k13.weight_bytes() == w13.numel() * 4


def test_a_platform_op_without_expert_kernels_gets_the_reference(monkeypatch):
    """FusedMoE hands ExpertKernels only to an op that says it accepts them."""
    import llmhal.ops.registry as registry
    from llmhal.config import EngineConfig, ModelConfig, set_current_config
    from llmhal.layers.fused_moe import FusedMoE
    from llmhal.ops.expert_kernels import ExpertKernels

    def stacked_only(*args, **kwargs):
        raise AssertionError("a stacked-only op was given expert kernels")

    monkeypatch.setattr(registry, "get_op", lambda name: stacked_only)
    model = ModelConfig("x", hf_config=None, dtype=torch.float32, architecture="x", max_model_len=8)
    with set_current_config(EngineConfig(model=model)):
        layer = FusedMoE(3, 1, 8, 8, prefix="experts")
    w13, w2 = torch.randn(3, 16, 8), torch.randn(3, 8, 8)
    k13 = ExpertKernels([lambda r, w=w: r @ w.T for w in w13])
    k2 = ExpertKernels([lambda r, w=w: r @ w.T for w in w2])
    x, logits = torch.randn(4, 8), torch.randn(4, 3)
    from llmhal.ops.fused_moe import fused_moe

    torch.testing.assert_close(layer.run_op(x, k13, k2, logits), fused_moe(x, w13, w2, logits, 1))


def _fp8_blocks(w: torch.Tensor, block: int = 32):
    """DeepSeek-V3's layout: e4m3 weights with one float32 ``weight_scale_inv`` per 32x32 block
    (amax / 448), and the values they stand for."""
    n, k = w.shape
    blocks = w.reshape(n // block, block, k // block, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    w8 = (w / full).to(torch.float8_e4m3fn)
    return {"weight": w8, "weight_scale_inv": scale}, w8.float() * full


def test_fp8_block_experts_match_the_dequantized_model(mixtral, tmp_path):
    """An FP8 checkpoint in DeepSeek-V3's form (block scales, dynamic activations): experts,
    attention and all kept in fp8; the router, in no ignore list, stays float."""
    qcfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": [32, 32]}  # fmt: skip
    quant, ref = write_pair(
        tmp_path, lambda name, w: _fp8_blocks(w), qcfg, base=mixtral, suffixes=SUFFIXES
    )
    q_report, ref_report = assert_greedy_parity(quant, ref, logprob_atol=LOGPROB_ATOL)
    assert q_report.quantization == "fp8"
    assert q_report.weight_bytes < 0.6 * ref_report.weight_bytes


def test_online_fp8_quantizes_the_experts(qwen3_moe, tmp_path):
    """quantization="fp8" on a plain MoE checkpoint: every expert quantized per output channel as
    it loads (as vLLM's online FP8 MoE method does)."""
    from tests.quantization.test_fp8 import quantize

    def reference(name, w):
        w8, s = quantize(w, per_channel=True)
        return {"weight": w}, w8.float() * s

    plain, ref = write_pair(tmp_path, reference, None, base=qwen3_moe, suffixes=SUFFIXES)
    q_report, ref_report = assert_greedy_parity(
        plain, ref, logprob_atol=LOGPROB_ATOL, quantization="fp8"
    )
    assert q_report.quantization == "fp8"
    assert q_report.weight_bytes < 0.6 * ref_report.weight_bytes
