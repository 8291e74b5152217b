"""compressed-tensors: checkpoints produced in the test by the compressed-tensors library itself.

A tiny module tree with HF names is given a quantization config (the library's preset schemes),
weight scales are calibrated with the library's ``calculate_qparams`` (what its min-max observer
does), and ``ModelCompressor`` compresses it into the on-disk tensors and config. The reference is
the library's own decompression (``decompress_model``) and, for W8A8, its fake-quantized forward.
"""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from llmhal.layers.weights import WeightLoadError
from llmhal.quantization.compressed_tensors import CompressedTensorsConfig
from llmhal.quantization.compressed_tensors_schemes import CTW8A8Int8Method, CTWNA16Method
from llmhal.quantization.fp8 import Fp8LinearMethod
from llmhal.testing.quant_layers import (
    assert_close_to_reference,
    build_linear,
    exact_quant_kernel,  # noqa: F401 (autouse fixture)
    finish,
    layer_output,
    load_tensors,
    relative_error,
    weight_bytes,
)

ct = pytest.importorskip("compressed_tensors")

HIDDEN, HEAD, HEADS, KV = 256, 32, 4, 2
MODULES = {
    "model.layers.0.self_attn.q_proj": (HEADS * HEAD, HIDDEN),
    "model.layers.0.self_attn.k_proj": (KV * HEAD, HIDDEN),
    "model.layers.0.self_attn.v_proj": (KV * HEAD, HIDDEN),
    "model.layers.0.self_attn.o_proj": (HIDDEN, HEADS * HEAD),
    "lm_head": (64, HIDDEN),
}
QKV = {"q": "q_proj", "k": "k_proj", "v": "v_proj"}


def _tree(seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    root = nn.Module()
    for name, (out, inp) in MODULES.items():
        parent = root
        parts = name.split(".")
        for p in parts[:-1]:
            if not hasattr(parent, p):
                parent.add_module(p, nn.Module())
            parent = getattr(parent, p)
        lin = nn.Linear(inp, out, bias=False)
        lin.weight.data = torch.randn(out, inp, generator=gen) * 0.05
        parent.add_module(parts[-1], lin)
    return root


def _calibrate(model: nn.Module, act_amax: float) -> None:
    from compressed_tensors.quantization.utils import calculate_qparams

    for mod in model.modules():
        scheme = getattr(mod, "quantization_scheme", None)
        if scheme is None:
            continue
        args, w = scheme.weights, mod.weight.data
        if args.strategy == "group":
            v = w.view(w.shape[0], -1, args.group_size)
            lo, hi = v.amin(-1), v.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif args.strategy == "block":
            bn, bk = args.block_structure
            pad = (0, -w.shape[1] % bk, 0, -w.shape[0] % bn)  # ragged edges: zeros change no max
            w = torch.nn.functional.pad(w, pad)
            v = w.view(w.shape[0] // bn, bn, w.shape[1] // bk, bk)
            lo, hi = v.amin((1, 3)), v.amax((1, 3))
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zp = calculate_qparams(lo, hi, args)
        mod.weight_scale.data = scale.reshape(mod.weight_scale.shape).to(mod.weight_scale.dtype)
        if hasattr(mod, "weight_zero_point"):
            zp = zp.reshape(mod.weight_zero_point.shape).to(mod.weight_zero_point.dtype)
            mod.weight_zero_point.data = zp
        if hasattr(mod, "input_scale"):
            mod.input_scale.data.fill_(act_amax / 448.0)


def make_checkpoint(
    scheme: str | dict[str, Any], seed: int = 0, act_amax: float = 4.0, fmt: str | None = None
):
    """(quantization_config dict, compressed state dict, decompressed model) for ``scheme``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    model = _tree(seed)
    if isinstance(scheme, str):
        qscheme = preset_name_to_scheme(scheme, ["Linear"])
    else:
        qscheme = QuantizationScheme(targets=["Linear"], **scheme)
    qc = QuantizationConfig(
        config_groups={"group_0": qscheme},
        ignore=["lm_head"],
        quantization_status=QuantizationStatus.FROZEN,
    )
    apply_quantization_config(model, qc, show_progress=False)
    _calibrate(model, act_amax)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as folder:  # config.json exactly as the library writes it
        compressor.update_config(folder)
        config = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]
    reference = copy.deepcopy(model)
    compressor.decompress_model(reference)
    return config, state, reference


def tensors_of(state: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
    return {k[len(module) + 1 :]: v for k, v in state.items() if k.startswith(module + ".")}


def ref_weight(reference: nn.Module, module: str) -> torch.Tensor:
    return reference.get_submodule(module).weight.data.to(torch.float64)


def build_qkv(config: dict[str, Any], state, dtype=torch.float32) -> nn.Module:
    layer = build_linear(
        CompressedTensorsConfig.from_config(config), "qkv",
        hidden=HIDDEN, head=HEAD, heads=HEADS, kv_heads=KV, dtype=dtype,
    )  # fmt: skip
    per_shard = {s: tensors_of(state, f"model.layers.0.self_attn.{m}") for s, m in QKV.items()}
    names = per_shard["q"].keys()
    load_tensors(layer, {n: {s: per_shard[s][n] for s in QKV} for n in names})
    return finish(layer)


O_PROJ = "model.layers.0.self_attn.o_proj"


def build_o_proj(config: dict[str, Any], state, dtype=torch.float32) -> nn.Module:
    """The checkpoint's o_proj as a replicated layer, loaded and finished (one shard, unlike qkv)."""
    layer = build_linear(
        CompressedTensorsConfig.from_config(config), "replicated",
        in_features=HEADS * HEAD, out_features=HIDDEN, dtype=dtype,
    )  # fmt: skip
    load_tensors(layer, tensors_of(state, O_PROJ))
    return finish(layer)


def qkv_reference(reference: nn.Module) -> torch.Tensor:
    return torch.cat([ref_weight(reference, f"model.layers.0.self_attn.{m}") for m in QKV.values()])


@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM", "W8A16"])
def test_int_weight_only_qkv_matches_library_decompression(preset):
    config, state, reference = make_checkpoint(preset)
    assert config["format"] == "pack-quantized"
    layer = build_qkv(config, state)
    assert isinstance(layer.quant_method, CTWNA16Method)
    assert_close_to_reference(layer, qkv_reference(reference), atol=1e-4, rtol=1e-5)
    dense = 2 * HEADS * HEAD * HIDDEN * 4  # float32 bytes of q, k and v
    assert weight_bytes(layer) < dense * (0.2 if preset.startswith("W4") else 0.35)


def test_w8a16_naive_format():
    config, state, reference = make_checkpoint("W8A16", seed=9, fmt="naive-quantized")
    assert config["format"] == "naive-quantized"
    assert state["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    layer = build_qkv(config, state)
    assert isinstance(layer.quant_method, CTWNA16Method)
    assert_close_to_reference(layer, qkv_reference(reference), atol=1e-4, rtol=1e-5)


def test_w4a16_replicated_in_bf16():
    config, state, reference = make_checkpoint("W4A16", seed=1)
    layer = build_o_proj(config, state, dtype=torch.bfloat16)
    assert_close_to_reference(layer, ref_weight(reference, O_PROJ), atol=0.03, rtol=0.02)


def test_w8a8_int8_dynamic_per_token_matches_library_forward():
    config, state, reference = make_checkpoint("W8A8", seed=2)
    assert config["format"] == "int-quantized"
    layer = build_qkv(config, state)
    assert isinstance(layer.quant_method, CTW8A8Int8Method)
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(0))
    y = layer_output(layer, x)
    with torch.no_grad():
        lib = torch.cat(
            [reference.get_submodule(f"model.layers.0.self_attn.{m}")(x) for m in QKV.values()], -1
        )
    # Per-token symmetric int8 activations, int32 accumulation, then both scales: emulated here.
    sx = x.abs().amax(dim=1, keepdim=True) / 127.0
    xq = torch.round(x / sx).clamp(-128, 127)
    exact_int8 = (xq.double() * sx.double()) @ qkv_reference(reference).T
    torch.testing.assert_close(y.double(), exact_int8, atol=1e-4, rtol=1e-5)
    # The library's fake-quantized forward rounds activations on a grid of amax/127.5 instead of
    # amax/127 (vLLM's kernels use 127): both are int8 activation quantization of the same size.
    assert relative_error(y, lib) < 0.02
    assert relative_error(y, x @ qkv_reference(reference).float().T) < 0.02
    assert weight_bytes(layer) < 2 * HEADS * HEAD * HIDDEN * 1.1


@pytest.mark.parametrize("preset", ["FP8", "FP8_DYNAMIC"])
def test_fp8_schemes_match_library_weights(preset):
    config, state, reference = make_checkpoint(preset, seed=3)
    assert config["format"] == "float-quantized"
    layer = build_qkv(config, state)
    assert isinstance(layer.quant_method, Fp8LinearMethod)
    assert layer.quant_method.scheme.static_input_scale == (preset == "FP8")
    assert_close_to_reference(layer, qkv_reference(reference), atol=1e-4, rtol=1e-5)


def test_fp8_block_scheme():
    config, state, reference = make_checkpoint("FP8_BLOCK", seed=4)
    layer = build_o_proj(config, state)
    assert layer.quant_method.scheme.block == (128, 128)
    assert_close_to_reference(layer, ref_weight(reference, O_PROJ), atol=1e-4, rtol=1e-5)


def test_group_act_order_g_idx():
    # The library no longer writes weight_g_idx (actorder "group" was removed), but older
    # checkpoints have it: w[n, k] = (q[n, k] - zp[n, g_idx[k]]) * s[n, g_idx[k]].
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    config, state, _ = make_checkpoint("W4A16_ASYM", seed=5)
    config["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    name = "model.layers.0.self_attn.q_proj"
    t = tensors_of(state, name)
    k, n = HIDDEN, HEADS * HEAD
    g_idx = (torch.randperm(k, generator=torch.Generator().manual_seed(5)) % (k // 128)).int()
    t["weight_g_idx"] = g_idx
    q = unpack_from_int32(t["weight_packed"], 4, t["weight_shape"]).double()
    zp = unpack_from_int32(t["weight_zero_point"], 4, (n, k // 128), packed_dim=0).double()
    gi = g_idx.long()
    w = (q - zp[:, gi]) * t["weight_scale"].double()[:, gi]
    layer = build_linear(
        CompressedTensorsConfig.from_config(config),
        "replicated",
        in_features=k,
        out_features=n,
    )
    load_tensors(layer, t)
    finish(layer)
    assert layer.quant_kernels[0][1] is not None  # runs with an activation permutation
    assert_close_to_reference(layer, w, atol=1e-4, rtol=1e-5)


def test_targets_ignore_and_regex_precedence():
    config, _, _ = make_checkpoint("W4A16")
    config["config_groups"]["group_1"] = {
        "targets": ["re:.*o_proj$"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        "format": "pack-quantized",
    }
    c = CompressedTensorsConfig.from_config(config)
    assert c.scheme_for("model.layers.0.self_attn.o_proj", "Linear").weights.num_bits == 8
    assert c.scheme_for("model.layers.0.self_attn.q_proj", "Linear").weights.num_bits == 4
    assert c.scheme_for("lm_head", "Linear") is None
    head = build_linear(c, "lm_head", vocab=64, hidden=HIDDEN)
    assert type(head.quant_method).__name__ == "UnquantizedLinearMethod"
    config["ignore"] = ["model.layers.0.self_attn.k_proj"]
    with pytest.raises(ValueError, match="quantized differently"):
        build_linear(CompressedTensorsConfig.from_config(config), "qkv",
                     hidden=HIDDEN, head=HEAD, heads=HEADS, kv_heads=KV)  # fmt: skip


def test_unsupported_configs_are_refused_with_reasons():
    config, _, _ = make_checkpoint("W4A16")
    with pytest.raises(ValueError, match="sparsity"):
        CompressedTensorsConfig.from_config(
            {**config, "sparsity_config": {"format": "sparse-bitmask"}}
        )
    with pytest.raises(ValueError, match="state 'frozen'"):
        CompressedTensorsConfig.from_config({**config, "quantization_status": "frozen"})
    w4a8 = copy.deepcopy(config)
    w4a8["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"scheme W4int\(group\)A8int.*not supported\. Supported:"):
        build_linear(CompressedTensorsConfig.from_config(w4a8), "replicated",
                     in_features=HIDDEN, out_features=64)  # fmt: skip


def test_bad_checkpoint_tensors_name_the_tensor():
    config, state, _ = make_checkpoint("W4A16_ASYM", seed=6)
    name = "model.layers.0.self_attn.o_proj"
    c = CompressedTensorsConfig.from_config(config)
    t = tensors_of(state, name)
    layer = build_linear(c, "replicated", in_features=HEADS * HEAD, out_features=HIDDEN)
    load_tensors(layer, {k: v for k, v in t.items() if k != "weight_zero_point"})
    with pytest.raises(WeightLoadError, match=r"o_proj\.weight_zero_point \(never loaded\)"):
        finish(layer)
    layer = build_linear(c, "replicated", in_features=HEADS * HEAD, out_features=HIDDEN)
    load_tensors(layer, {**t, "weight_shape": torch.tensor([HIDDEN, 64])})
    with pytest.raises(WeightLoadError, match=r"weight_shape: the checkpoint says \(256, 64\)"):
        finish(layer)
    with pytest.raises(WeightLoadError, match=r"o_proj\.weight_scale: .*\(256, 2\)"):
        load_tensors(layer, {"weight_scale": torch.zeros(HIDDEN, 2)})


@pytest.mark.parametrize("preset", ["W4A16_ASYM", "W8A16"])
def test_platform_kernel(preset):
    config, state, reference = make_checkpoint(preset, seed=8)
    layer = build_qkv(config, state)
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(8))
    assert relative_error(layer_output(layer, x), x.double() @ qkv_reference(reference).T) < 1e-2


def quantize_linear(w: torch.Tensor, preset: str | dict[str, Any]):
    """One nn.Linear quantized and compressed by the library: (tensors, library dequantization).
    ``preset``: a preset name, or a scheme's arguments as make_checkpoint takes them."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    root = nn.Module()
    root.add_module("proj", nn.Linear(w.shape[1], w.shape[0], bias=False))
    root.proj.weight.data = w.clone()
    qc = QuantizationConfig(
        config_groups={
            "group_0": preset_name_to_scheme(preset, ["Linear"])
            if isinstance(preset, str)
            else QuantizationScheme(targets=["Linear"], **preset)
        },
        quantization_status=QuantizationStatus.FROZEN,
    )
    apply_quantization_config(root, qc, show_progress=False)
    _calibrate(root, act_amax=4.0)
    compressor = ModelCompressor.from_pretrained_model(root)
    compressor.compress_model(root)
    tensors = {k: v.clone() for k, v in root.proj.state_dict().items()}
    compressor.decompress_model(root)
    return tensors, root.proj.weight.data.clone()


@pytest.mark.parametrize("preset", ["W4A16_ASYM", "FP8_DYNAMIC"])
def test_model_level_greedy_parity(tmp_path, preset):
    from llmhal.testing.quant_models import assert_greedy_parity, write_pair

    config, _state, _ref = make_checkpoint(preset)
    quant, ref = write_pair(tmp_path, lambda name, w: quantize_linear(w, preset), config)
    q_report, ref_report = assert_greedy_parity(quant, ref, logprob_atol=1e-3)
    assert q_report.quantization == "compressed-tensors"
    assert q_report.weight_bytes < ref_report.weight_bytes


def test_w8a8_int8_matmul_fallbacks(monkeypatch):
    config, state, _ = make_checkpoint("W8A8", seed=10)
    layer = build_qkv(config, state)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    want = layer_output(layer, x)
    real = torch._int_mm

    def needs_17_rows(a, b):  # what CUDA's _int_mm demands
        if a.shape[0] <= 16:
            raise RuntimeError("self.size(0) needs to be greater than 16")
        return real(a, b)

    monkeypatch.setattr(torch, "_int_mm", needs_17_rows)
    torch.testing.assert_close(layer_output(layer, x), want, atol=0, rtol=0)
    assert layer.w8a8_pad_rows and layer.w8a8_int_mm

    def missing(a, b):
        raise NotImplementedError("no int8 matmul on this device")

    monkeypatch.setattr(torch, "_int_mm", missing)
    torch.testing.assert_close(layer_output(layer, x), want, atol=1e-5, rtol=1e-6)
    assert not layer.w8a8_int_mm
