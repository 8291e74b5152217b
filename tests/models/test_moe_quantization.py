"""Quantized experts: ``experts_int8`` (online int8 per-channel experts from an unquantized
checkpoint) through ``LLM`` against the same model with its experts round-tripped through int8 by
an independent quantizer, and the error for a method that has no MoE side."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from llmhal.testing.model_parity import save_tiny_model, tiny_config
from llmhal.testing.tiny_models import make_tokenizer


def _int8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """Independent reference: per output row, scale = max |w| / 127, round to nearest."""
    out = torch.empty_like(w, dtype=torch.float64)
    for idx in range(w.shape[0]):
        row = w[idx].double()
        s = row.abs().max() / 127
        out[idx] = torch.round(row / s).clamp(-127, 127) * s
    return out.float()


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixtral")
    cfg = tiny_config(
        "MixtralForCausalLM",
        vocab_size=384,  # the prompts of llmhal.testing.quant_models use ids up to 300
        num_local_experts=4,
        num_experts_per_tok=2,
        initializer_range=0.1,
    )
    save_tiny_model(cfg, folder)
    make_tokenizer(cfg.vocab_size).save_pretrained(str(folder))
    return folder


def test_experts_int8_config():
    from llmhal.layers.linear import ReplicatedLinear
    from llmhal.quantization.experts_int8 import ExpertsInt8Config, quantize_rows
    from llmhal.quantization.registry import get_quantization_config

    cls = get_quantization_config("experts_int8")
    assert cls is ExpertsInt8Config and cls.is_online()
    assert cls.online_config().get_quant_method(object.__new__(ReplicatedLinear), "x") is None
    w = torch.randn(5, 33) * 3
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and s.shape == (5,)
    torch.testing.assert_close(q.float() * s[:, None], _int8_round_trip(w), atol=1e-6, rtol=0)


def test_experts_int8_matches_the_int8_round_trip_through_llm(mixtral, tmp_path):
    from safetensors.torch import load_file, save_file

    from llmhal.testing.quant_models import assert_greedy_parity

    ref = tmp_path / "reference"
    shutil.copytree(mixtral, ref)
    state = load_file(str(mixtral / "model.safetensors"))
    experts = [n for n in state if ".experts." in n]
    assert experts
    for name in experts:
        state[name] = _int8_round_trip(state[name])
    save_file(state, str(ref / "model.safetensors"))
    q_report, ref_report = assert_greedy_parity(
        mixtral, ref, logprob_atol=2e-3, quantization="experts_int8"
    )
    assert q_report.quantization == "experts_int8"
    # The experts are most of the weights; int8 holds them in a quarter of fp32's bytes.
    assert q_report.weight_bytes < 0.6 * ref_report.weight_bytes


def test_a_method_without_moe_support_is_refused_by_name():
    from llmhal.config import EngineConfig, ModelConfig, set_current_config
    from llmhal.layers.fused_moe import FusedMoE
    from llmhal.quantization.base import QuantizationConfig
    from llmhal.quantization.unquantized import UnquantizedLinearMethod

    class LinearOnly(QuantizationConfig):
        @classmethod
        def get_name(cls):
            return "linear_only"

        @classmethod
        def get_supported_act_dtypes(cls):
            return [torch.float32]

        @classmethod
        def from_config(cls, config):
            return cls()

        def get_quant_method(self, layer, prefix):
            return UnquantizedLinearMethod()

    model = ModelConfig("x", hf_config=None, dtype=torch.float32, architecture="x", max_model_len=8)
    config = EngineConfig(model=model)
    with set_current_config(config), pytest.raises(NotImplementedError) as err:
        FusedMoE(4, 2, 16, 32, quant_config=LinearOnly(), prefix="model.layers.0.mlp.experts")
    msg = str(err.value)
    assert "'linear_only'" in msg and "model.layers.0.mlp.experts" in msg
    assert "experts_int8" in msg


def test_checkpoint_config_names_the_method(mixtral, tmp_path):
    """A checkpoint may also declare it (vLLM accepts quant_method experts_int8 in config.json)."""
    from llmhal import LLM, SamplingParams

    shutil.copytree(mixtral, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "experts_int8"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes=4 << 20)
    assert llm.load_report.quantization == "experts_int8"
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0)
    )
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_method_with_a_kernel_of_its_own_keeps_the_shared_experts():
    """The shared experts' output reaches the op through run_op; a method whose apply calls a
    kernel of its own (an out-of-tree one) never passes it on, and the layer adds it itself."""
    from llmhal.config import EngineConfig, ModelConfig, set_current_config
    from llmhal.layers.fused_moe import FusedMoE, UnquantizedFusedMoEMethod
    from llmhal.ops.fused_moe import fused_moe

    model = ModelConfig("x", hf_config=None, dtype=torch.float32, architecture="x", max_model_len=8)
    with set_current_config(EngineConfig(model=model)):
        layer = FusedMoE(4, 2, 16, 32, prefix="model.layers.0.mlp.experts")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in (layer.w13_weight, layer.w2_weight):
            w.copy_(torch.randn(w.shape, generator=gen) * 0.1)
    x, logits, shared = (torch.randn(3, n, generator=gen) for n in (16, 4, 16))

    def routed() -> torch.Tensor:
        return fused_moe(x, layer.w13_weight, layer.w2_weight, logits, layer.top_k, **layer.routing)

    want = routed() + shared

    class OwnKernel(UnquantizedFusedMoEMethod):
        def apply(self, layer, x, router_logits):
            return routed()

    with torch.no_grad():
        torch.testing.assert_close(layer(x, logits, shared_output=shared), want)  # in-tree
        layer.quant_method = OwnKernel()
        torch.testing.assert_close(layer(x, logits, shared_output=shared), want)
