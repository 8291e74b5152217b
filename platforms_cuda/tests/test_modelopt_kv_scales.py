"""ModelOpt FP8 checkpoints with an fp8 KV cache: the attention scales load where they belong.

NVIDIA ModelOpt writes them as ``self_attn.k_proj.k_scale`` and ``self_attn.v_proj.v_scale`` (vLLM
remaps them onto the attention layer); they used to be routed to the merged ``qkv_proj`` and refused.
The checkpoint here is written the way ModelOpt writes one: fp8 weights with per-tensor
``weight_scale`` and static ``input_scale`` per projection, plus the two KV scales per layer.
"""

from __future__ import annotations

import torch

from llmhal.config import CacheConfig, EngineConfig, ModelConfig, set_current_config
from llmhal.models.llama import LlamaForCausalLM
from llmhal.models.utils import missing_parameters
from llmhal.quantization.module_names import kv_cache_scale_name
from llmhal.testing.model_parity import tiny_config
from llmhal_cuda.quantization.modelopt import ModelOptConfig

HF_QUANT_CONFIG = {
    "producer": {"name": "modelopt", "version": "0.29.0"},
    "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]},
}  # fmt: skip


def _modelopt_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if ".layers." in name and name.endswith("proj.weight"):
            scale = t.abs().amax().float() / 448
            module = name.removesuffix(".weight")
            out[name] = (t / scale).to(torch.float8_e4m3fn)
            out[module + ".weight_scale"] = scale
            out[module + ".input_scale"] = torch.tensor(0.02)
        else:
            out[name] = t
    return out


def test_kv_scales_of_a_modelopt_checkpoint_reach_the_attention_layers():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf_config = tiny_config("LlamaForCausalLM", num_hidden_layers=2)
    ckpt = _modelopt_checkpoint(AutoModelForCausalLM.from_config(hf_config).state_dict())
    for i, (k, v) in enumerate([(0.25, 0.5), (0.125, 0.75)]):
        ckpt[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(k)
        ckpt[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(v)
    quant = ModelOptConfig.from_config(HF_QUANT_CONFIG)
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", hf_config=hf_config, dtype=torch.float32,
                          architecture="LlamaForCausalLM", max_model_len=64),
        cache=CacheConfig(block_size=16),
        attention_backend="reference",
        quant_config=quant,
    )  # fmt: skip
    with set_current_config(cfg):
        model = LlamaForCausalLM(hf_config)
        loaded = model.load_weights(ckpt.items())
    assert missing_parameters(model, loaded) == []
    scales = [(layer.self_attn.attn.k_scale.item(), layer.self_attn.attn.v_scale.item())
              for layer in model.model.layers]  # fmt: skip
    assert scales == [(0.25, 0.5), (0.125, 0.75)]


def test_kv_scale_names_of_each_exporter():
    p = "model.layers.3.self_attn"
    for name in (f"{p}.k_proj.k_scale", f"{p}.k_proj.output_scale", f"{p}.k_scale"):
        assert kv_cache_scale_name(name) == f"{p}.attn.k_scale", name
    assert kv_cache_scale_name(f"{p}.v_proj.v_scale") == f"{p}.attn.v_scale"
    assert kv_cache_scale_name(f"{p}.k_proj.weight_scale") is None
    assert ModelOptConfig("FP8").get_cache_scale(f"{p}.v_proj.v_scale") == f"{p}.attn.v_scale"
