"""GGUF files of llama.cpp's ``deepseek2`` architecture: DeepSeek-V2, V2-Lite, V2.5 and V3/R1.

:class:`~llmhal.model_loader.gguf_loader.GGUFFile` calls in here for what differs from the other
attention models (metadata keys and tensor names as gguf-py's constants define them for
``MODEL_ARCH.DEEPSEEK2``):

* **config**: ``deepseek2.attention.q_lora_rank`` (absent: a plain ``q_proj``, as in V2-Lite),
  ``attention.kv_lora_rank``, ``rope.dimension_count`` (``qk_rope_head_dim``). Newer converters
  describe the attention as llama.cpp runs it, MQA over the latent: ``head_count_kv`` 1,
  ``key_length`` = kv_lora_rank + rope and ``value_length`` = kv_lora_rank, with the per-head sizes
  in ``key_length_mla`` (nope + rope) and ``value_length_mla`` (``v_head_dim``); older files have
  no ``*_mla`` keys and give the per-head sizes in ``key_length``/``value_length``. Experts:
  ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``,
  ``expert_shared_count``, ``leading_dense_block_count`` (``first_k_dense_replace``),
  ``expert_weights_scale`` (``routed_scaling_factor``; absent: 1), ``expert_weights_norm``
  (absent: no renormalization), ``expert_gating_func`` (1 softmax = V2, 2 sigmoid = V3; absent:
  softmax, as llama.cpp reads old V2 files), ``expert_group_count`` /
  ``expert_group_used_count`` (grouped top-k; absent: one group). YaRN: ``rope.scaling.type`` yarn,
  ``factor``, ``original_context_length``, ``yarn_log_multiplier`` (the converter writes
  ``0.1 * mscale_all_dim``; DeepSeek's configs have ``mscale == mscale_all_dim``, so both are read
  back from it; absent, llama.cpp scales nothing, nor does llmhal), ``yarn_beta_fast``/
  ``yarn_beta_slow`` when present (else DeepSeek's 32 and 1).
  V3 is recognised by sigmoid gating or its choice bias ``exp_probs_b``.
* **tensors**: ``attn_q`` or ``attn_q_a``/``attn_q_a_norm``/``attn_q_b``, ``attn_kv_a_mqa``,
  ``attn_kv_a_norm``, ``attn_output``; the dense layers' ``ffn_gate/up/down``; the MoE layers'
  ``ffn_gate_inp`` (router), ``ffn_*_exps`` (experts, kept quantized), ``ffn_*_shexp`` (the shared
  experts as one MLP of ``expert_shared_count * expert_feed_forward_length``) and
  ``exp_probs_b.bias`` (V3's ``e_score_correction_bias``).
* **kv_b_proj**: older files store ``attn_kv_b`` as is. Newer converters split it for llama.cpp's
  absorbed MLA into ``attn_k_b`` (per head, the key rows *transposed*: [heads, kv_lora_rank,
  qk_nope]) and ``attn_v_b`` ([heads, v_head_dim, kv_lora_rank]). The transposed half runs across
  the quantization blocks, so the two are dequantized and put back together as the float
  ``kv_b_proj`` llmhal's MLA layer reads (its decode absorbs it itself). That matrix is small
  (kv_lora_rank x heads x (nope + v): 512 x 128 x 256 in V3, 16.8 M values a layer).

Rotary: DeepSeek rotates interleaved pairs, which is llama.cpp's own layout, so no rows are permuted.
"""

from __future__ import annotations

from typing import Any

import torch

from llmhal.model_loader.gguf_ssm import need_meta

DEEPSEEK2 = "deepseek2"
V2 = ("deepseek_v2", "DeepseekV2ForCausalLM")
V3 = ("deepseek_v3", "DeepseekV3ForCausalLM")
SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
# DeepSeek's YaRN betas (the converter may leave them out).
BETA_FAST, BETA_SLOW = 32.0, 1.0

_ATTN = (
    "self_attn.q_proj", "self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj",
    "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm", "self_attn.kv_b_proj",
    "self_attn.k_b_proj", "self_attn.v_b_proj", "self_attn.o_proj",
    "input_layernorm", "post_attention_layernorm",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip
# llama.cpp's fixed MoE names (per block) -> the HF module below ``model.layers.<i>.``.
_MOE = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
K_B, V_B, KV_B = "self_attn.k_b_proj", "self_attn.v_b_proj", "self_attn.kv_b_proj"
SPLIT_KV_B = (f"{K_B}.weight", f"{V_B}.weight")  # HF names of the split halves' tensors


def deepseek_arch(f: Any) -> tuple[str, str]:
    """(model_type, HF architecture): V3 when the experts are scored by sigmoid or biased."""
    gating = f._meta("expert_gating_func")
    biased = any(name.endswith("exp_probs_b.bias") for name in f.tensors)
    return V3 if (gating is not None and int(gating) == SIGMOID) or biased else V2


def split_kv_b(f: Any) -> bool:
    """True when the file stores kv_b_proj as llama.cpp's split ``attn_k_b`` / ``attn_v_b``."""
    return "blk.0.attn_k_b.weight" in f.tensors


def deepseek_config(f: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """The HF DeepSeek config from the file's metadata (module docstring); ``cfg`` holds the
    common fields already read."""
    model_type, _ = deepseek_arch(f)
    rope = need_meta(f, "rope.dimension_count")
    if f._meta("attention.key_length_mla") is not None:
        qk, v = need_meta(f, "attention.key_length_mla"), need_meta(f, "attention.value_length_mla")
    else:
        qk, v = need_meta(f, "attention.key_length"), need_meta(f, "attention.value_length")
    heads = cfg["num_attention_heads"]
    cfg.pop("head_dim", None)  # key_length is the latent's width, not a head's
    q_lora = f._meta("attention.q_lora_rank")
    groups = int(f._meta("expert_group_count", 1) or 1)
    norm, scale = f._meta("expert_weights_norm"), f._meta("expert_weights_scale")
    out = {
        **cfg,
        "num_key_value_heads": heads,  # MLA expands the latent to every head
        "kv_lora_rank": need_meta(f, "attention.kv_lora_rank"),
        "q_lora_rank": None if q_lora is None else int(q_lora),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": qk - rope,
        "v_head_dim": v,
        "n_routed_experts": need_meta(f, "expert_count"),
        "num_experts_per_tok": need_meta(f, "expert_used_count"),
        "moe_intermediate_size": need_meta(f, "expert_feed_forward_length"),
        "n_shared_experts": int(f._meta("expert_shared_count", 0) or 0),
        "first_k_dense_replace": int(f._meta("leading_dense_block_count", 0) or 0),
        "routed_scaling_factor": 1.0 if scale is None else float(scale),
        "norm_topk_prob": bool(norm) if norm is not None else False,
        "n_group": groups,
        "topk_group": int(f._meta("expert_group_used_count", groups) or groups),
    }
    if model_type == V3[0]:
        out["topk_method"] = "noaux_tc"
        out["rope_interleave"] = True
    else:
        out["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    scaling = out.pop("rope_scaling", None)
    if scaling is not None and scaling["rope_type"] == "yarn":
        # llama.cpp scales cos/sin by 1 and the softmax by (1 + log_mul * ln factor) ** 2, which is
        # DeepSeek's YaRN with mscale == mscale_all_dim = log_mul / 0.1; without the key the
        # multiplier is 0: no scaling at all (attention_factor 1, no mscale_all_dim).
        log_mul = f._meta("rope.scaling.yarn_log_multiplier")
        if log_mul is None or float(log_mul) == 0.0:
            scaling["attention_factor"] = 1.0
        else:
            m_all = float(log_mul) / 0.1
            scaling.update(mscale=m_all, mscale_all_dim=m_all)
        scaling.update(
            beta_fast=float(f._meta("rope.scaling.yarn_beta_fast", BETA_FAST)),
            beta_slow=float(f._meta("rope.scaling.yarn_beta_slow", BETA_SLOW)),
        )
    if scaling is not None:
        out["rope_scaling"] = scaling
    return out


def deepseek_names(gmap: Any, n_layers: int) -> dict[str, str]:
    """GGUF base (or full) tensor name -> HF name, for every tensor a deepseek2 file may hold."""
    out = {}
    for name in ("model.embed_tokens", "model.norm", "lm_head"):
        base = gmap.get_name(name)
        if base is not None:
            out[base] = name
    for i in range(n_layers):
        p = f"model.layers.{i}."
        for module in _ATTN:
            base = gmap.get_name(p + module)
            if base is not None:
                out[base] = p + module
        out.update({f"blk.{i}.{g}": p + h for g, h in _MOE.items()})
        # The V3 router's choice bias is one suffixed tensor (its HF name is not <module>.bias).
        out[f"blk.{i}.exp_probs_b.bias"] = p + "mlp.gate.e_score_correction_bias"
    return out


def deepseek_shapes(f: Any, c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> the shape the file must give it (3-D experts and k_b/v_b as stored)."""
    hidden, vocab, heads = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    lora, q_lora = c["kv_lora_rank"], c["q_lora_rank"]
    e, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (vocab, hidden)
    v3 = c["topk_method"] == "noaux_tc"
    split = split_kv_b(f)
    for i in range(c["num_hidden_layers"]):
        layer: dict[str, tuple[int, ...]] = {
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "self_attn.kv_a_proj_with_mqa.weight": (lora + rope, hidden),
            "self_attn.kv_a_layernorm.weight": (lora,),
            "self_attn.o_proj.weight": (hidden, heads * v),
        }
        if q_lora is None:
            layer["self_attn.q_proj.weight"] = (heads * (nope + rope), hidden)
        else:
            layer.update({
                "self_attn.q_a_proj.weight": (q_lora, hidden),
                "self_attn.q_a_layernorm.weight": (q_lora,),
                "self_attn.q_b_proj.weight": (heads * (nope + rope), q_lora),
            })  # fmt: skip
        if split:
            layer[f"{K_B}.weight"] = (heads, lora, nope)
            layer[f"{V_B}.weight"] = (heads, v, lora)
        else:
            layer[f"{KV_B}.weight"] = (heads * (nope + v), lora)
        if i < c["first_k_dense_replace"]:
            dense = c["intermediate_size"]
            layer.update({
                "mlp.gate_proj.weight": (dense, hidden),
                "mlp.up_proj.weight": (dense, hidden),
                "mlp.down_proj.weight": (hidden, dense),
            })  # fmt: skip
        else:
            layer.update({
                "mlp.gate.weight": (e, hidden),
                "mlp.experts.gate_proj.weight": (e, inter, hidden),
                "mlp.experts.up_proj.weight": (e, inter, hidden),
                "mlp.experts.down_proj.weight": (e, hidden, inter),
            })  # fmt: skip
            shared = c["n_shared_experts"] * inter
            if shared:
                layer.update({
                    "mlp.shared_experts.gate_proj.weight": (shared, hidden),
                    "mlp.shared_experts.up_proj.weight": (shared, hidden),
                    "mlp.shared_experts.down_proj.weight": (hidden, shared),
                })  # fmt: skip
            if v3:
                layer["mlp.gate.e_score_correction_bias"] = (e,)
        out.update({f"model.layers.{i}.{k}": s for k, s in layer.items()})
    return out


def kv_b_types(types: dict[str, Any]) -> dict[str, Any]:
    """The quantization config's types with each split k_b/v_b pair replaced by the float
    ``kv_b_proj`` :func:`kv_b_from_split` yields."""
    from llmhal.quantization.gguf_dequant import ggml_type

    out = {}
    for name, t in types.items():
        if name.endswith(K_B):
            out[name.removesuffix(K_B) + KV_B] = ggml_type("F32").type_id
        elif not name.endswith(V_B):
            out[name] = t
    return out


def kv_b_from_split(f: Any, hf_name: str) -> tuple[str, torch.Tensor] | None:
    """For the ``attn_k_b`` tensor of a layer: (``...kv_b_proj.weight``, float32 [heads * (nope +
    v), kv_lora_rank]) rebuilt from it and ``attn_v_b``; None for ``attn_v_b`` (already used)."""
    from llmhal.quantization.gguf_dequant import dequantize

    if hf_name.endswith(f"{V_B}.weight"):
        return None
    block = hf_name.removesuffix(f"{K_B}.weight")  # "model.layers.<i>."
    layer = block.removeprefix("model.layers.").rstrip(".")
    k_name, v_name = f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"
    k_b = dequantize(f.raw(k_name), f.tensor_type(k_name))  # [heads, lora, nope]
    v_b = dequantize(f.raw(v_name), f.tensor_type(v_name))  # [heads, v, lora]
    lora = k_b.shape[1]
    kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [heads, nope + v, lora]
    return f"{block}{KV_B}.weight", kv_b.reshape(-1, lora).contiguous()
