"""fp8 checkpoint errors name the tensor as the checkpoint names it: a missing scale of one
projection is reported as ``...q_proj.weight_scale``, the tensor a user would search the files for,
not by the merged layer it would have been loaded into."""

from __future__ import annotations

import pytest
import torch

from llmhal.config import CacheConfig, EngineConfig, ModelConfig, set_current_config
from llmhal.layers.weights import WeightLoadError
from llmhal.models.llama import LlamaForCausalLM
from llmhal.quantization.fp8 import Fp8Config
from llmhal.testing.model_parity import tiny_config


def test_a_missing_fp8_scale_is_named_as_the_checkpoint_names_it():
    hf_config = tiny_config("LlamaForCausalLM", num_hidden_layers=1)
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", hf_config=hf_config, dtype=torch.float32,
                          architecture="LlamaForCausalLM", max_model_len=64),
        cache=CacheConfig(block_size=16),
        attention_backend="reference",
        quant_config=Fp8Config(),
    )  # fmt: skip
    with set_current_config(cfg):
        model = LlamaForCausalLM(hf_config)
    p = "model.layers.0.self_attn."
    h, kv = (
        hf_config.hidden_size,
        hf_config.num_key_value_heads * (hf_config.hidden_size // hf_config.num_attention_heads),
    )
    ckpt = {
        p + "q_proj.weight": torch.zeros(h, h, dtype=torch.float8_e4m3fn),
        p + "k_proj.weight": torch.zeros(kv, h, dtype=torch.float8_e4m3fn),
        p + "v_proj.weight": torch.zeros(kv, h, dtype=torch.float8_e4m3fn),
        p + "k_proj.weight_scale": torch.tensor(1.0),
        p + "v_proj.weight_scale": torch.tensor(1.0),
    }
    with set_current_config(cfg), pytest.raises(WeightLoadError) as err:
        model.load_weights(ckpt.items())
    msg = str(err.value)
    assert msg.startswith(f"the checkpoint has no {p}q_proj.weight_scale: ")
    assert f"{p}qkv_proj.weight_scale merges q_proj, k_proj, v_proj" in msg
    assert "but not ['q']" in msg
