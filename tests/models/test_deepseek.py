"""DeepSeek-V2/V3 (MLA + routed and shared experts) against HF transformers on tiny random checkpoints.

Each case saves a tiny model with transformers' own classes, loads it into our class, prefills four
prompts of 1 to 23 tokens in one varlen step over the latent paged cache and decodes greedily,
batched: logits within 1e-4 of the logit scale of HF's forward, tokens equal to HF ``generate``
(8 steps in the fast tier, 64 in the slow one, with both MLA backends there).
"""

from __future__ import annotations

import pytest
import torch

from llmhal.testing.model_parity import (
    build_model,
    check_parity,
    save_tiny_model,
    saved_once,
    tiny_config,
)

COMMON = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.5,
    # A wider initialisation than HF's: the router's choices are clear, not rounding noise.
    "initializer_range": 0.1,
}
# DeepSeek's YaRN; mscale differs from mscale_all_dim so the cos/sin factor is not 1.
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
}
CASES = {
    "v2-greedy-q-proj": ("DeepseekV2ForCausalLM", {"q_lora_rank": None, "topk_method": "greedy"}),
    "v2-group-limited-q-lora-yarn": (
        "DeepseekV2ForCausalLM",
        {
            "q_lora_rank": 24,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "rope_scaling": YARN,
        },
    ),
    "v3-grouped-bias-yarn": (
        "DeepseekV3ForCausalLM",
        {
            "q_lora_rank": 24,
            "n_group": 4,
            "topk_group": 2,
            "norm_topk_prob": True,
            "rope_scaling": YARN,
        },
    ),
    "v3-one-group-neox-rope-no-renorm": (
        "DeepseekV3ForCausalLM",
        {
            "q_lora_rank": None,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": False,
            "rope_interleave": False,
            "first_k_dense_replace": 2,
        },
    ),
    "v2-all-experts": ("DeepseekV2ForCausalLM", {"q_lora_rank": 24, "num_experts_per_tok": 8}),
}
FAST = ["v2-group-limited-q-lora-yarn", "v3-grouped-bias-yarn"]


def _save(case: str, folder) -> object:
    arch, kw = CASES[case]
    hf = save_tiny_model(tiny_config(arch, **{**COMMON, **kw}), folder)
    biased = False
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # HF starts the V3 bias at zero; a random one checks it steers the choice.
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g))
                biased = True
    if biased:
        hf.save_pretrained(str(folder), safe_serialization=True)
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return saved_once(tmp_path_factory, lambda case, folder: (_save(case, folder), folder))


@pytest.mark.parametrize("case", FAST)
def test_matches_hf(case, checkpoints):
    hf, folder = checkpoints(case)
    report = check_parity(hf, folder, decode_steps=8, rel_tol=1e-4)
    report.raise_on_failure()
    assert report.backends[0].endswith("mla")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu_mla", "torch_mla", "reference_mla"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf_for_64_steps(case, backend, checkpoints):
    hf, folder = checkpoints(case)
    report = check_parity(hf, folder, decode_steps=64, rel_tol=1e-4, attention_backend=backend)
    report.raise_on_failure()
    assert report.backends == [backend]
    assert all(len(t) == 64 for t in report.tokens.values())


def test_v3_bias_and_dense_layers_load(checkpoints):
    from llmhal.layers.fused_moe import FusedMoE

    hf, folder = checkpoints("v3-grouped-bias-yarn")
    model, _ = build_model(folder)
    sparse = [
        isinstance(getattr(layer.mlp, "experts", None), FusedMoE) for layer in model.model.layers
    ]
    assert sparse == [False, True, True]
    theirs = hf.model.layers[1].mlp.gate.e_score_correction_bias
    ours = model.model.layers[1].mlp.experts.e_score_correction_bias
    assert torch.equal(ours, theirs) and bool(ours.abs().sum() > 0)


def test_latent_cache_bytes_per_token(checkpoints):
    """The cache holds kv_lora_rank + qk_rope_head_dim values a token a layer, nothing per head."""
    from llmhal.testing.model_parity import PagedRunner

    _, folder = checkpoints("v3-grouped-bias-yarn")
    model, config = build_model(folder)
    runner = PagedRunner(model, config, num_blocks=4)
    per_token = sum(layer.kv_cache[0, 0].numel() * 4 for layer in runner.layers)
    assert per_token == 3 * (32 + 8) * 4
    mha = 3 * 2 * 4 * (16 + 8) * 4  # the same attention with expanded per-head K and V
    assert per_token * 4 < mha


def test_mha_backend_is_refused_with_the_mla_ones_listed(checkpoints):
    from llmhal.attention.selector import AttentionBackendError

    _, folder = checkpoints("v2-greedy-q-proj")
    with pytest.raises(AttentionBackendError, match=r"serves mha layers, not mla(.|\n)*torch_mla"):
        build_model(folder, attention_backend="reference")


def test_bf16_logits_close_to_hf_fp32(checkpoints):
    """bf16 weights, activations and latent cache (the router in float32, as DeepSeek's): logits
    within bf16 accuracy of the fp32 model. Every expert is chosen, since bf16 rounding flips the
    router's near-ties (top-2 of 8: 0.097 of the logit scale), which says nothing about MLA."""
    hf, folder = checkpoints("v2-all-experts")
    report = check_parity(
        hf, folder, dtype=torch.bfloat16, rel_tol=3e-2, compare_tokens=False, decode_steps=4
    )
    report.raise_on_failure()


PROMPTS = [[5, 17, 42], [7, 100, 23, 9, 88, 64, 3, 250, 31], [300], list(range(11, 29))]


@pytest.fixture(scope="module")
def engine_checkpoint(tmp_path_factory):
    from llmhal.testing.tiny_models import make_tokenizer

    folder = tmp_path_factory.mktemp("deepseek_engine")
    arch, kw = CASES["v3-grouped-bias-yarn"]
    cfg = tiny_config(arch, **{**COMMON, **kw, "vocab_size": 384})
    hf = save_tiny_model(cfg, folder)
    make_tokenizer(cfg.vocab_size).save_pretrained(str(folder))
    return hf, folder


def test_engine_matches_transformers_across_preemption(engine_checkpoint):
    """Through LLM: a latent cache of 6 blocks (3 layers x 40 values x 4 bytes x 16 tokens each)
    holds the longest request (18 + 24 tokens) but not all four at once, so requests are
    preempted and recomputed; greedy tokens stay HF's."""
    from llmhal import LLM, SamplingParams
    from llmhal.testing.model_parity import hf_greedy

    hf, folder = engine_checkpoint
    block = 3 * (32 + 8) * 4 * 16
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=6 * block, block_size=16)
    assert llm.load_report.kv_cache_bytes == 6 * block  # the latent layout, nothing per head
    assert llm.load_report.attention_backends == ["cpu_mla"]  # the CPU platform's own
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert llm.engine.stats.preemptions > 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24), prompt


def test_fp8_latent_cache_through_the_engine(engine_checkpoint):
    """kv_cache_dtype=fp8_e4m3 stores the latent in one byte a value (a quarter of fp32). Against
    the fp32 cache on this tiny random model (measured): the first token equal for all four
    prompts, its log-probability within 0.05; greedy agreement then lasts 1 to 24 steps (e4m3
    keeps 3 mantissa bits and the tiny model's next-token distributions are nearly flat)."""
    from llmhal import LLM, SamplingParams

    _, folder = engine_checkpoint
    block = 3 * (32 + 8) * 16
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    runs = {}
    for dtype, blocks in (("auto", 4 * 8), ("fp8_e4m3", 8)):
        llm = LLM(
            str(folder), dtype="float32", kv_cache_dtype=dtype,
            kv_cache_memory_bytes=blocks * block, block_size=16,
        )  # fmt: skip
        assert llm.load_report.num_blocks == 8
        runs[dtype] = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for exact, fp8 in zip(runs["auto"], runs["fp8_e4m3"], strict=True):
        a, b = exact.outputs[0], fp8.outputs[0]
        assert a.token_ids[0] == b.token_ids[0]
        tok = a.token_ids[0]
        assert abs(a.logprobs[0][tok].logprob - b.logprobs[0][tok].logprob) < 0.1


_TRITON_PARITY = r"""
import sys, torch
from transformers import AutoModelForCausalLM
from llmhal.testing.model_parity import check_parity
hf = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="eager").float().eval()
report = check_parity(hf, sys.argv[1], decode_steps=64, rel_tol=1e-4, attention_backend="triton_mla")
report.raise_on_failure()
print("OK", report.max_rel_diff)
"""


@pytest.mark.slow
def test_triton_mla_in_the_interpreter_matches_hf(checkpoints):
    """triton_mla's decode kernel in Triton's CPU interpreter (a subprocess: TRITON_INTERPRET is
    read when the kernel is first decorated), 64 greedy steps (measured: 1.1e-6 at 8 steps)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    _, folder = checkpoints("v3-grouped-bias-yarn")
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_PARITY, str(folder)],
        env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_experts_int8(engine_checkpoint):
    """quantization="experts_int8" quantizes the routed experts only (the float32 router, its
    bias, the shared experts and MLA stay unquantized); greedy output follows the float model."""
    from llmhal import LLM, SamplingParams
    from llmhal.layers.fused_moe import FusedMoE

    _, folder = engine_checkpoint
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    runs = {}
    for quant in (None, "experts_int8"):
        llm = LLM(str(folder), dtype="float32", quantization=quant, kv_cache_memory_bytes=1 << 20)
        runs[quant] = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    model = llm.engine.runner.model
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.w13_weight.dtype == torch.int8 for m in experts)
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    for exact, int8 in zip(runs[None], runs["experts_int8"], strict=True):
        a, b = exact.outputs[0], int8.outputs[0]
        tok = a.token_ids[0]
        assert b.token_ids[0] == tok
        assert abs(a.logprobs[0][tok].logprob - b.logprobs[0][tok].logprob) < 0.05


def test_prefix_caching_and_ngram_drafts_keep_the_output(engine_checkpoint):
    """The latent cache under prefix caching (a second run reads the prompts' cached blocks) and
    under ngram speculative decoding (multi-token verification steps: prefill-like spans after
    cached tokens): greedy tokens identical to the plain engine's."""
    from llmhal import LLM, SamplingParams

    _, folder = engine_checkpoint
    prompts = [[5, 17, 42, 5, 17, 42, 5, 17], [7, 100, 23, 9, 7, 100, 23, 9, 7], PROMPTS[3]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 20)
    want = [o.outputs[0].token_ids for o in plain.generate(batch, params)]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
             "prompt_lookup_max": 3}  # fmt: skip
    for kw in ({"enable_prefix_caching": True}, {"speculative_config": ngram}):
        llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 20, **kw)
        for _ in range(2):
            assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == want, kw


def test_quantized_kv_b_proj_is_absorbed_through_the_layer(engine_checkpoint):
    """With quantization="fp8" (online) kv_b_proj keeps no float weight parameter; the MLA layer
    reads W_UK/W_UV through the layer itself, equal to what the quantized layer computes."""
    from llmhal import LLM, SamplingParams

    _, folder = engine_checkpoint
    llm = LLM(str(folder), dtype="float32", quantization="fp8", kv_cache_memory_bytes=1 << 20)
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) == 3
    attn = llm.engine.runner.model.model.layers[0].self_attn
    w_uk, w_uv = attn.attn.mla_weights(torch.float32, torch.device("cpu"))
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = attn.kv_b_proj(x).view(5, 4, 16 + 12)
    want = torch.cat(
        [torch.einsum("tl,hnl->thn", x, w_uk), torch.einsum("tl,hvl->thv", x, w_uv)], -1
    )
    assert float((got - want).abs().max() / got.abs().max()) < 1e-5


def test_quantized_dense_deepseek_records_its_decode_steps(tmp_path):
    """The MLA attention path makes no torch call in a decode step (norms and rotary on views,
    the cpu_mla kernel): a DeepSeek-V2 whose layers are all dense and whose linear layers are AWQ
    (native kernels) replays recorded decode steps, equal to its eager run."""
    from llmhal import LLM, SamplingParams
    from llmhal.platforms import get_current_platform
    from llmhal.testing.model_parity import save_tiny_model, tiny_config
    from llmhal.testing.quant_models import PROMPTS as QUANT_PROMPTS
    from llmhal.testing.quant_models import awq_rtn, write_pair
    from llmhal.testing.tiny_models import make_tokenizer

    if not get_current_platform().capabilities.graphs:
        pytest.skip("this platform records no decode graphs")
    base = tmp_path / "base"
    # Every in_features a multiple of AWQ's 64-wide groups, every out_features of its 8-value packs.
    shape = {**COMMON, "hidden_size": 128, "intermediate_size": 256, "kv_lora_rank": 64,
             "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
             "q_lora_rank": None, "first_k_dense_replace": 2, "num_hidden_layers": 2,
             "vocab_size": 384}  # fmt: skip
    cfg = tiny_config("DeepseekV2ForCausalLM", **shape)
    save_tiny_model(cfg, base)
    make_tokenizer(cfg.vocab_size).save_pretrained(str(base))
    qcfg = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True,
            "version": "gemm"}  # fmt: skip
    suffixes = ("q_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight",
                "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight")  # fmt: skip
    quant, _ = write_pair(tmp_path, lambda name, w: awq_rtn(w, 64), qcfg, base=base,
                          suffixes=suffixes)  # fmt: skip
    kw = {"kv_cache_memory_bytes": 4 << 20, "max_num_seqs": 4, "dtype": "float32"}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in QUANT_PROMPTS], params)
        return [list(o.outputs[0].token_ids) for o in outs]

    graphs = LLM(str(quant), **kw)
    got = run(graphs)
    dg = graphs.engine.runner.decode_graphs
    assert graphs.load_report.attention_backends == ["cpu_mla"]
    assert dg is not None and dg.refused is None, dg and dg.refused
    assert dg.replays > 0
    assert got == run(LLM(str(quant), enforce_eager=True, **kw))
