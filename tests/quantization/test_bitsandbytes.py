"""bitsandbytes: checkpoints serialized by bitsandbytes itself.

Saving through transformers (``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))``
then ``save_pretrained``) needs ``accelerate``, which is not installed here; transformers' saved
tensors are exactly the modules' ``state_dict()``, so the test builds ``bnb.nn.Linear4bit`` /
``Linear8bitLt`` modules, lets bitsandbytes quantize them on the CPU (``.to("cpu")``) and takes
their ``state_dict()`` (``weight``, ``weight.absmax``, ``weight.quant_map``,
``weight.nested_*``, ``weight.quant_state.bitsandbytes__nf4`` / ``weight``, ``SCB``,
``weight_format``), with the config dict of transformers' ``BitsAndBytesConfig.to_dict()``.
References: bitsandbytes' own dequantization and its modules' forward.
"""

from __future__ import annotations

import pytest
import torch

from llmhal.layers.weights import WeightLoadError
from llmhal.quantization.bitsandbytes import BitsAndBytesConfig, BnB4bitMethod, BnB8bitMethod
from llmhal.testing.quant_layers import (
    assert_close_to_reference,
    build_linear,
    exact_quant_kernel,  # noqa: F401 (autouse fixture)
    finish,
    layer_output,
    weight_bytes,
)

bnb = pytest.importorskip("bitsandbytes")


def hf_config(**kw) -> dict:
    from transformers import BitsAndBytesConfig as HFConfig

    d = HFConfig(**kw).to_dict()
    return {k: (v.value if hasattr(v, "value") else v) for k, v in d.items()}


def linear4bit(w: torch.Tensor, quant_type: str, double: bool, blocksize: int = 64):
    out_f, in_f = w.shape
    lin = bnb.nn.Linear4bit(in_f, out_f, bias=False, compress_statistics=double,
                            quant_type=quant_type, compute_dtype=torch.float32)  # fmt: skip
    lin.weight = bnb.nn.Params4bit(
        w.clone(), requires_grad=False, quant_type=quant_type,
        compress_statistics=double, blocksize=blocksize,
    )  # fmt: skip
    lin = lin.to("cpu")  # bitsandbytes quantizes here
    ref = bnb.functional.dequantize_4bit(lin.weight.data, lin.weight.quant_state)
    return lin, lin.state_dict(), ref.to(torch.float64)


def load(layer, config: BitsAndBytesConfig, shards: dict, module: str = "proj") -> None:
    """Route serialized tensors as a model does, after the config's renaming."""
    params = dict(layer.named_parameters(recurse=False))
    for sid, state in shards.items():
        named = [(f"{module}.{k}", v) for k, v in state.items()]
        for name, tensor in config.map_checkpoint_weights(named):
            param = params[name.removeprefix(f"{module}.")]
            if sid is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, sid)


def rand(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def check_against_library(layer, c, state, ref, lin, lib_tol: float, dense_share: float) -> None:
    """Load one module's serialized ``state`` and check the layer three ways: against the
    dequantized weight ``ref``, against the library's own forward ``lin`` (on the activations
    ``assert_close_to_reference`` draws: 5 tokens, seed 0), and its bytes against ``dense_share``
    of the float32 weight."""
    load(layer, c, {None: state})
    finish(layer)
    y = assert_close_to_reference(layer, ref, atol=1e-5, rtol=1e-5)
    n, k = ref.shape
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(y, lin(x), atol=lib_tol, rtol=lib_tol)
    assert weight_bytes(layer) < n * k * 4 * dense_share


@pytest.mark.parametrize(("quant_type", "double"), [("nf4", True), ("fp4", False)])
def test_4bit_checkpoint_matches_bitsandbytes(quant_type, double):
    w = rand(96, 128, 0)
    lin, state, ref = linear4bit(w, quant_type, double)
    assert "weight.absmax" in state and any(k.startswith("weight.quant_state.") for k in state)
    c = BitsAndBytesConfig.from_config(
        hf_config(
            load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double
        )
    )
    layer = build_linear(c, "replicated", in_features=128, out_features=96)
    assert isinstance(layer.quant_method, BnB4bitMethod)
    check_against_library(layer, c, state, ref, lin, lib_tol=1e-5, dense_share=0.2)


def test_qkv_shards_merge_into_one_state():
    sizes = {"q": 64, "k": 32, "v": 32}
    made = {s: linear4bit(rand(n, 64, i), "nf4", True) for i, (s, n) in enumerate(sizes.items())}
    c = BitsAndBytesConfig.from_config(
        hf_config(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    )
    layer = build_linear(c, "qkv", hidden=64, head=16, heads=4, kv_heads=2, bias=True)
    load(layer, c, {s: m[1] for s, m in made.items()})
    bias = torch.randn(128)
    layer.bias.data.copy_(bias)
    finish(layer)
    assert len(layer.bnb_parts) == 1
    ref = torch.cat([m[2] for m in made.values()])
    assert_close_to_reference(layer, ref, bias=bias, atol=1e-5, rtol=1e-5)


def test_shards_whose_blocks_do_not_line_up_stay_separate():
    # 3 rows x 40 inputs = 120 values: not a multiple of the 64-value blocks.
    made = [linear4bit(rand(3, 40, s), "nf4", False) for s in (1, 2)]
    c = BitsAndBytesConfig.from_config(hf_config(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    layer = build_linear(c, "merged", in_features=40, out_features=3)
    load(layer, c, {i: m[1] for i, m in enumerate(made)})
    finish(layer)
    assert len(layer.bnb_parts) == 2
    assert_close_to_reference(layer, torch.cat([m[2] for m in made]), atol=1e-5, rtol=1e-5)


def test_int8_checkpoint_matches_bitsandbytes_cpu_backend():
    w = rand(64, 96, 3)
    lin = bnb.nn.Linear8bitLt(96, 64, bias=False, has_fp16_weights=False)
    lin.weight = bnb.nn.Int8Params(w.clone(), requires_grad=False, has_fp16_weights=False)
    lin = lin.to("cpu")
    state = lin.state_dict()
    assert set(state) == {"weight", "SCB", "weight_format"}
    c = BitsAndBytesConfig.from_config(hf_config(load_in_8bit=True))
    layer = build_linear(c, "replicated", in_features=96, out_features=64)
    assert isinstance(layer.quant_method, BnB8bitMethod)
    ref = state["weight"].double() * state["SCB"].double()[:, None] / 127
    check_against_library(layer, c, state, ref, lin, lib_tol=1e-4, dense_share=0.3)


def test_online_nf4_quantization():
    w = rand(64, 128, 4)
    assert BitsAndBytesConfig.is_online()
    c = BitsAndBytesConfig.online_config()
    layer = build_linear(c, "merged", in_features=128, out_features=32)
    layer.weight.weight_loader(layer.weight, w[:32], 0)
    layer.weight.weight_loader(layer.weight, w[32:], 1)
    finish(layer)
    packed, state = bnb.functional.quantize_4bit(w, blocksize=64, quant_type="nf4")
    ref = bnb.functional.dequantize_4bit(packed, state).double()
    assert_close_to_reference(layer, ref, atol=1e-5, rtol=1e-5)
    assert weight_bytes(layer) < w.numel() * 4 * 0.2


def test_renaming_and_format_check():
    c = BitsAndBytesConfig.from_config(hf_config(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    names = [n for n, _ in c.map_checkpoint_weights([
        ("m.q_proj.weight", torch.zeros(1)), ("m.q_proj.weight.absmax", torch.zeros(1)),
        ("m.q_proj.weight.quant_state.bitsandbytes__nf4", torch.zeros(1)),
        ("m.q_proj.weight.nested_quant_map", torch.zeros(1)), ("m.norm.weight", torch.zeros(1)),
        ("m.o_proj.weight_format", torch.tensor(0, dtype=torch.uint8)),
    ])]  # fmt: skip
    assert names == [
        "m.q_proj.weight", "m.q_proj.weight_absmax", "m.q_proj.weight_quant_state",
        "m.q_proj.weight_nested_quant_map", "m.norm.weight",
    ]  # fmt: skip
    with pytest.raises(WeightLoadError, match="o_proj.weight_format: .*format 1 is not supported"):
        list(c.map_checkpoint_weights([("m.o_proj.weight_format", torch.tensor(1))]))


def test_bad_checkpoints_name_the_problem():
    w = rand(32, 64, 5)
    _lin, state, _ref = linear4bit(w, "nf4", True)
    c = BitsAndBytesConfig.from_config(
        hf_config(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    )
    layer = build_linear(c, "replicated", in_features=64, out_features=32)
    load(layer, c, {None: {k: v for k, v in state.items() if k != "weight.absmax"}})
    with pytest.raises(WeightLoadError, match=r"o_proj\.weight_absmax \(never loaded\)"):
        finish(layer)
    fp4 = BitsAndBytesConfig.from_config(
        hf_config(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True)
    )
    layer = build_linear(fp4, "replicated", in_features=64, out_features=32)
    load(layer, fp4, {None: state})
    with pytest.raises(WeightLoadError, match="the weight is nf4, the config says fp4"):
        finish(layer)
    layer = build_linear(c, "replicated", in_features=128, out_features=32)
    load(layer, c, {None: state})
    with pytest.raises(
        WeightLoadError, match=r"quant_state shape \(32, 64\), expected \(32, 128\)"
    ):
        finish(layer)


def test_config_and_availability(monkeypatch):
    with pytest.raises(ValueError, match="exactly one of load_in_4bit and load_in_8bit"):
        BitsAndBytesConfig.from_config({"quant_method": "bitsandbytes"})
    c = BitsAndBytesConfig.from_config(
        hf_config(load_in_4bit=True, llm_int8_skip_modules=["o_proj"])
    )
    assert c.quant_type == "fp4"  # transformers' default
    layer = build_linear(c, "replicated", in_features=64, out_features=32)
    assert type(layer.quant_method).__name__ == "UnquantizedLinearMethod"
    assert (
        build_linear(c, "lm_head", vocab=32, hidden=64).quant_method.__class__.__name__
        == "UnquantizedLinearMethod"
    )

    class Tpu:
        device_type = "tpu"

    (reason,) = BitsAndBytesConfig.availability(Tpu())
    assert "no backend for device type 'tpu'" in reason
    import llmhal.quantization.bitsandbytes as mod

    monkeypatch.setattr(mod, "is_available", lambda name: False)
    reasons = BitsAndBytesConfig.availability(Tpu())
    assert reasons[0] == "bitsandbytes is not installed (pip install bitsandbytes)"


def test_layer_output_in_bf16():
    w = rand(64, 128, 6)
    _lin, state, ref = linear4bit(w, "nf4", False)
    c = BitsAndBytesConfig.from_config(hf_config(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    layer = build_linear(c, "replicated", in_features=128, out_features=64, dtype=torch.bfloat16)
    load(layer, c, {None: state})
    finish(layer)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(6))
    y = layer_output(layer, x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), x.double() @ ref.T, atol=0.02, rtol=0.02)


@pytest.mark.parametrize("double", [False, True])
def test_model_level_greedy_parity(tmp_path, double):
    from llmhal.testing.quant_models import assert_greedy_parity, write_pair

    def quantize(name: str, w: torch.Tensor):
        _lin, state, ref = linear4bit(w, "nf4", double)
        return state, ref

    qcfg = hf_config(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double)
    quant, ref = write_pair(tmp_path, quantize, qcfg)
    q_report, ref_report = assert_greedy_parity(quant, ref, logprob_atol=1e-3)
    assert q_report.quantization == "bitsandbytes"
    assert q_report.weight_bytes < ref_report.weight_bytes


def test_model_level_online_quantization(tmp_path):
    from llmhal.testing.quant_models import assert_greedy_parity, write_pair

    def reference(name: str, w: torch.Tensor):  # bitsandbytes' own nf4 of each projection
        packed, state = bnb.functional.quantize_4bit(w, blocksize=64, quant_type="nf4")
        return {"weight": w}, bnb.functional.dequantize_4bit(packed, state)

    plain, ref = write_pair(tmp_path, reference, None)
    q_report, ref_report = assert_greedy_parity(
        plain, ref, logprob_atol=1e-3, quantization="bitsandbytes"
    )
    assert q_report.quantization == "bitsandbytes"
    assert q_report.weight_bytes < ref_report.weight_bytes / 2


def test_4bit_weights_stored_as_bf16_bytes():
    # bnb_4bit_quant_storage=bfloat16 (used for FSDP) stores the same bytes under another dtype.
    w = rand(32, 64, 7)
    lin = bnb.nn.Linear4bit(64, 32, bias=False, quant_type="nf4", quant_storage=torch.bfloat16)
    lin.weight = bnb.nn.Params4bit(
        w.clone(), requires_grad=False, quant_type="nf4", compress_statistics=False,
        quant_storage=torch.bfloat16,
    )  # fmt: skip
    lin = lin.to("cpu")
    state = lin.state_dict()
    assert state["weight"].dtype == torch.bfloat16
    ref = bnb.functional.dequantize_4bit(lin.weight.data, lin.weight.quant_state).double()
    c = BitsAndBytesConfig.from_config(
        hf_config(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage="bfloat16")
    )
    layer = build_linear(c, "replicated", in_features=64, out_features=32)
    load(layer, c, {None: state})
    finish(layer)
    assert_close_to_reference(layer, ref, atol=1e-5, rtol=1e-5)
