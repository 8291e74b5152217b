"""DeepSeek-V2/V3 from llama.cpp-format GGUF files (architecture ``deepseek2``).

Each case builds a tiny random DeepSeek model with transformers' classes and writes it as llama.cpp's
converter lays it out (the gguf package's ``GGUFWriter``, gguf-py's ``deepseek2.*`` keys and tensor
names): the newer converters' MQA-style attention metadata (``key_length_mla``/``value_length_mla``)
with kv_b_proj split into ``attn_k_b`` (transposed) and ``attn_v_b``, or the older files' per-head
lengths with ``attn_kv_b`` whole; experts as 3-D ``ffn_*_exps`` in Q4_0/Q8_0, shared experts, the
leading dense layers, V3's sigmoid gating with its ``exp_probs_b`` bias, grouped top-k and YaRN.
The values the file holds are put back into the transformers model, and our model built from the
file matches it: logits within 1e-4 of the logit scale, greedy tokens equal, one varlen prefill of
four prompts and batched decode steps.
"""

from __future__ import annotations

import pytest
import torch

from llmhal.testing.gguf_files import store_tensor
from llmhal.testing.model_parity import compare_with_hf, save_tiny_model, saved_once, tiny_config
from llmhal.testing.tiny_models import make_tokenizer
from tests.models.test_deepseek import COMMON
from tests.models.test_gguf_moe import build_from_gguf

# llama.cpp's converter stores mscale_all_dim only (yarn_log_multiplier = 0.1 * it), which is
# exact for DeepSeek's configs, where mscale equals it.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}  # fmt: skip
YARN_NO_LOG_MUL = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                   "attention_factor": 1.0, "beta_fast": 32, "beta_slow": 1}  # fmt: skip
CASES = {
    # V2-Lite's shape: no q_lora, plain softmax top-k; an older file with attn_kv_b whole, and
    # YaRN without yarn_log_multiplier (llama.cpp then scales neither cos/sin nor the softmax).
    "v2-q-proj-kv-b": (
        "DeepseekV2ForCausalLM",
        {"q_lora_rank": None, "topk_method": "greedy", "rope_scaling": YARN_NO_LOG_MUL},
        {"split_kv_b": False},
    ),
    # V3: q_lora, sigmoid with the choice bias, grouped top-k, renormalized, YaRN; k_b/v_b split.
    "v3-split-kv-b-yarn": (
        "DeepseekV3ForCausalLM",
        {
            "q_lora_rank": 32,
            "n_group": 4,
            "topk_group": 2,
            "norm_topk_prob": True,
            "rope_scaling": YARN,
        },
        {"split_kv_b": True},
    ),  # fmt: skip
}
EXPERTS = {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q8_0"}
ATTN = {
    "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}  # fmt: skip


def _qtype(name: str, param: torch.Tensor) -> str | None:
    """Q8_0 for matrices whose rows fill whole blocks of 32; routers, norms and the rest F32."""
    if param.dim() != 2 or name == "ffn_gate_inp" or param.shape[1] % 32:
        return None
    return "Q8_0"


def write_deepseek_gguf(hf, path, *, split_kv_b: bool) -> None:
    """``hf`` as llama.cpp's converter writes a deepseek2 file; ``hf`` then holds the file's values."""
    import gguf

    c = hf.config
    heads, lora, rope = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    nope, v = c.qk_nope_head_dim, c.v_head_dim
    v3 = c.model_type == "deepseek_v3"
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_vocab_size(c.vocab_size)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(lora)
    if split_kv_b:  # the newer converter: MQA over the latent, per-head sizes in *_mla
        w.add_head_count_kv(1)
        w.add_key_length(lora + rope)
        w.add_value_length(lora)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
    else:
        w.add_head_count_kv(heads)
        w.add_key_length(nope + rope)
        w.add_value_length(v)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob:
        w.add_expert_weights_norm(True)
    if v3:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
    w.add_rope_dimension_count(rope)
    scaling = c.rope_parameters
    if scaling.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        if scaling.get("mscale_all_dim"):
            w.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])

    def put(name: str, param: torch.Tensor, qtype: str | None) -> None:
        back = store_tensor(w, name, param, qtype)
        with torch.no_grad():
            param.copy_(back.view_as(param))

    params = dict(hf.named_parameters())
    put("token_embd.weight", params["model.embed_tokens.weight"], "Q8_0")
    put("output_norm.weight", params["model.norm.weight"], None)
    put("output.weight", params["lm_head.weight"], "Q8_0")
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf_mod, g in ATTN.items():
            prm = params.get(f"{p}{hf_mod}.weight")
            if prm is not None:
                put(f"blk.{i}.{g}.weight", prm, _qtype(g, prm))
        kv_b = params[f"{p}self_attn.kv_b_proj.weight"]
        if split_kv_b:  # as the converter splits it: per head, the key rows transposed
            per_head = kv_b.detach().view(heads, nope + v, lora)
            k_b = store_tensor(
                w, f"blk.{i}.attn_k_b.weight", per_head[:, :nope].transpose(1, 2), "F16"
            )
            v_b = store_tensor(
                w, f"blk.{i}.attn_v_b.weight", per_head[:, nope:].contiguous(), "Q8_0"
            )
            with torch.no_grad():
                kv_b.copy_(torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(kv_b.shape))
        else:
            put(f"blk.{i}.attn_kv_b.weight", kv_b, "Q8_0")
        if f"{p}mlp.experts.gate_up_proj" in params:
            inter = c.moe_intermediate_size
            gate_up = params[f"{p}mlp.experts.gate_up_proj"]
            for g, rows in (
                ("ffn_gate_exps", slice(0, inter)),
                ("ffn_up_exps", slice(inter, None)),
            ):
                part = gate_up.detach()[:, rows].clone()
                back = store_tensor(w, f"blk.{i}.{g}.weight", part, EXPERTS[g])
                with torch.no_grad():
                    gate_up[:, rows] = back
            put(
                f"blk.{i}.ffn_down_exps.weight",
                params[f"{p}mlp.experts.down_proj"],
                EXPERTS["ffn_down_exps"],
            )
            if v3:
                bias = dict(hf.named_buffers())[f"{p}mlp.gate.e_score_correction_bias"]
                put(f"blk.{i}.exp_probs_b.bias", bias, None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    def save(case: str, folder):
        arch, kw, how = CASES[case]
        hf = save_tiny_model(tiny_config(arch, **{**COMMON, **kw}), folder)
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for name, buf in hf.named_buffers():
                if name.endswith(
                    "e_score_correction_bias"
                ):  # steer the choice, as in test_deepseek
                    buf.copy_(0.1 * torch.randn(buf.shape, generator=g))
        write_deepseek_gguf(hf, folder / "model.gguf", **how)
        make_tokenizer(hf.config.vocab_size).save_pretrained(str(folder))  # for LLM
        return hf, folder / "model.gguf"

    return saved_once(tmp_path_factory, save)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf_on_the_file_values(case, files, monkeypatch):
    """The exact GGUF path (chosen experts' rows dequantized): 1e-4 of the logit scale."""
    monkeypatch.setenv("LLMHAL_GGUF_KERNEL", "dequant")
    hf, path = files(case)
    model, config = build_from_gguf(path)
    assert type(model).__name__ == CASES[case][0]
    compare_with_hf(hf, model, config, decode_steps=8, rel_tol=1e-4).raise_on_failure()


def test_config_read_from_the_metadata(files):
    from llmhal.model_loader.gguf_loader import GGUFFile

    hf, path = files("v3-split-kv-b-yarn")
    got = GGUFFile(path).config_dict()
    want = hf.config
    for key in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                "first_k_dense_replace", "moe_intermediate_size", "n_group", "topk_group",
                "norm_topk_prob", "num_attention_heads"):  # fmt: skip
        assert got[key] == getattr(want, key), key
    assert got["num_key_value_heads"] == want.num_attention_heads  # not the file's MQA 1
    assert got["routed_scaling_factor"] == pytest.approx(want.routed_scaling_factor)
    assert got["topk_method"] == "noaux_tc" and got["architectures"] == ["DeepseekV3ForCausalLM"]
    yarn = got["rope_scaling"]
    assert yarn["rope_type"] == "yarn" and yarn["factor"] == 4.0
    assert yarn["mscale_all_dim"] == pytest.approx(0.707) == yarn["mscale"]


def test_platform_kernels_keep_the_experts_quantized(files):
    """The default path: Q4_0/Q8_0 experts through the platform's fused_moe (as ExpertKernels) and
    quantized GEMM; the rebuilt kv_b_proj is float. Logits within the kernel's rounding."""
    hf, path = files("v3-split-kv-b-yarn")
    model, config = build_from_gguf(path)
    layer = model.model.layers[1]
    experts = layer.mlp.experts
    assert not hasattr(experts, "w13_weight")  # the raw rows live in the kernels only
    assert "gguf experts Q4_0/Q8_0" in experts.quant_method.describe(experts)
    kv_b = layer.self_attn.kv_b_proj
    assert kv_b.quant_method.describe(kv_b) == "unquantized float32"
    compare_with_hf(hf, model, config, decode_steps=8, rel_tol=5e-4).raise_on_failure()


def test_through_llm(files):
    from llmhal import LLM, SamplingParams

    hf, path = files("v2-q-proj-kv-b")
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, tokenizer=str(path.parent))
    prompt = [5, 17, 42, 9]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6))
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, 4:].tolist()
    assert out[0].outputs[0].token_ids == want
