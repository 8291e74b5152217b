"""``load_weights``: routing HF names into merged layers, quantized parameters, and its errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from llmhal.config import CacheConfig, EngineConfig, ModelConfig, set_current_config
from llmhal.layers.weights import WeightLoadError, set_weight_attrs
from llmhal.models.llama import LlamaForCausalLM
from llmhal.models.qwen3 import Qwen3ForCausalLM
from llmhal.models.utils import missing_parameters
from llmhal.quantization.base import QuantizationConfig, QuantizeMethodBase
from llmhal.testing.model_parity import tiny_config


def _engine_config(hf_config: Any, quant_config: QuantizationConfig | None = None) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model="tiny",
            hf_config=hf_config,
            dtype=torch.float32,
            architecture=hf_config.architectures[0],
            max_model_len=64,
        ),
        cache=CacheConfig(block_size=16),
        attention_backend="reference",
        quant_config=quant_config,
    )


def _build(cls: type, hf_config: Any, quant_config: QuantizationConfig | None = None):
    cfg = _engine_config(hf_config, quant_config)
    with set_current_config(cfg):
        return cls(hf_config), cfg


def _hf_state(arch: str, **kw: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf_config = tiny_config(arch, num_hidden_layers=1, **kw)
    return hf_config, AutoModelForCausalLM.from_config(hf_config).state_dict()


def test_qkv_and_gate_up_are_stacked_in_shard_order():
    hf_config, state = _hf_state("LlamaForCausalLM")
    model, cfg = _build(LlamaForCausalLM, hf_config)
    with set_current_config(cfg):
        loaded = model.load_weights(state.items())
    attn = model.model.layers[0].self_attn
    p = "model.layers.0.self_attn."
    expected = torch.cat(
        [state[p + "q_proj.weight"], state[p + "k_proj.weight"], state[p + "v_proj.weight"]]
    )
    assert torch.equal(attn.qkv_proj.weight, expected)
    mlp = model.model.layers[0].mlp
    m = "model.layers.0.mlp."
    assert torch.equal(
        mlp.gate_up_proj.weight,
        torch.cat([state[m + "gate_proj.weight"], state[m + "up_proj.weight"]]),
    )
    assert missing_parameters(model, loaded) == []
    assert "model.layers.0.self_attn.qkv_proj.weight" in loaded


def test_tied_head_ignores_lm_head_and_skips_rotary_buffers():
    hf_config, state = _hf_state("LlamaForCausalLM", tied=True)
    model, cfg = _build(LlamaForCausalLM, hf_config)
    junk = {
        "lm_head.weight": torch.full((256, 64), 7.0),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
    }
    with set_current_config(cfg):
        model.load_weights([*state.items(), *junk.items()])
    assert model.lm_head is model.model.embed_tokens
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])


def test_untied_model_reports_a_missing_lm_head():
    hf_config, state = _hf_state("LlamaForCausalLM")
    state.pop("lm_head.weight")
    model, cfg = _build(LlamaForCausalLM, hf_config)
    with set_current_config(cfg):
        loaded = model.load_weights(state.items())
    assert missing_parameters(model, loaded) == ["lm_head.weight"]


def test_unknown_tensor_is_named():
    hf_config, state = _hf_state("LlamaForCausalLM")
    model, cfg = _build(LlamaForCausalLM, hf_config)
    bad = [("model.layers.0.self_attn.q_norm.weight", torch.ones(16))]
    with set_current_config(cfg), pytest.raises(WeightLoadError) as err:
        model.load_weights(bad)
    msg = str(err.value)
    assert "'model.layers.0.self_attn.q_norm.weight'" in msg
    assert "'model.layers.0.self_attn' has o_proj, qkv_proj" in msg


def test_shape_mismatch_names_the_checkpoint_tensor():
    hf_config, _ = _hf_state("Qwen3ForCausalLM", head_dim=16)
    model, cfg = _build(Qwen3ForCausalLM, hf_config)
    bad = [("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 64))]
    with set_current_config(cfg), pytest.raises(WeightLoadError) as err:
        model.load_weights(bad)
    msg = str(err.value)
    assert "'model.layers.0.self_attn.k_proj.weight'" in msg
    assert "(3, 64)" in msg and "(32, 64)" in msg and "shard 'k'" in msg


def test_a_missing_shard_is_an_error():
    hf_config, state = _hf_state("LlamaForCausalLM")
    state.pop("model.layers.0.self_attn.v_proj.weight")
    model, cfg = _build(LlamaForCausalLM, hf_config)
    with (
        set_current_config(cfg),
        pytest.raises(WeightLoadError, match=r"qkv_proj.weight.*not \['v'\]"),
    ):
        model.load_weights(state.items())


class _FakeInt8Method(QuantizeMethodBase):
    """Stores int8 ``qweight`` and per-row ``scales``: enough to check routing and shards."""

    def create_weights(self, layer: nn.Module, input_size, output_sizes, params_dtype, **extra):
        loader = extra["weight_loader"]
        n = sum(output_sizes)
        qweight = nn.Parameter(torch.zeros(n, input_size, dtype=torch.int8), requires_grad=False)
        scales = nn.Parameter(torch.zeros(n, dtype=torch.float32), requires_grad=False)
        for p in (qweight, scales):
            set_weight_attrs(p, {"output_dim": 0, "weight_loader": loader})
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("scales", scales)

    def apply(self, layer, x, bias=None):
        w = layer.qweight.float() * layer.scales[:, None]
        return torch.nn.functional.linear(x, w, bias)


class _FakeQuantConfig(QuantizationConfig):
    """Quantizes the decoder linears and maps a k_proj KV-cache scale onto the attention layer."""

    @classmethod
    def get_name(cls) -> str:
        return "fake_int8"

    @classmethod
    def get_supported_act_dtypes(cls):
        return [torch.float32]

    @classmethod
    def from_config(cls, config):
        return cls()

    def get_quant_method(self, layer, prefix):
        return _FakeInt8Method() if ".layers." in prefix else None

    def get_cache_scale(self, name):
        if name.endswith(".k_proj.k_scale"):
            return name.replace(".k_proj.k_scale", ".attn.k_scale")
        return None


def test_quantized_parameters_route_by_module_and_shard():
    hf_config, state = _hf_state("LlamaForCausalLM")
    quant = _FakeQuantConfig()
    model, cfg = _build(LlamaForCausalLM, hf_config, quant)
    assert quant.packed_modules_mapping["qkv_proj"] == ["q_proj", "k_proj", "v_proj"]
    g = torch.Generator().manual_seed(0)
    ckpt: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        module = name.removesuffix(".weight")
        if ".layers." in name and name.endswith("proj.weight"):
            ckpt[module + ".qweight"] = torch.randint(
                -127, 128, t.shape, dtype=torch.int8, generator=g
            )
            ckpt[module + ".scales"] = torch.rand(t.shape[0], generator=g)
        else:
            ckpt[name] = t
    ckpt["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(0.25)
    with set_current_config(cfg):
        loaded = model.load_weights(ckpt.items())
    assert missing_parameters(model, loaded) == []
    attn = model.model.layers[0].self_attn
    p = "model.layers.0.self_attn."
    assert torch.equal(
        attn.qkv_proj.qweight,
        torch.cat([ckpt[p + s + ".qweight"] for s in ("q_proj", "k_proj", "v_proj")]),
    )
    assert torch.equal(
        attn.qkv_proj.scales,
        torch.cat([ckpt[p + s + ".scales"] for s in ("q_proj", "k_proj", "v_proj")]),
    )
    assert attn.attn.k_scale.item() == 0.25 and attn.attn.v_scale.item() == 1.0
