"""fp8: checkpoint tensors made here with torch's own fp8 conversion (as AutoFP8/llm-compressor
write them: ``weight = (w / scale).to(float8_e4m3fn)``), reference ``weight.float() * scale``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llmhal.layers.weights import WeightLoadError
from llmhal.platforms import Platform, PlatformCapabilities
from llmhal.quantization.fp8 import Fp8Config, Fp8LinearMethod
from llmhal.testing.isolation import switched_platform
from llmhal.testing.quant_layers import (
    assert_close_to_reference,
    build_linear,
    finish,
    layer_output,
    load_tensors,
    relative_error,
    weight_bytes,
)

FP8 = torch.float8_e4m3fn


class FakeFp8Platform(Platform):
    """A CPU-backed platform whose capability data differ (fp8 matmuls, fnuz fp8, no fp8)."""

    name = "fakefp8"
    device_type = "cpu"

    def __init__(self, **caps: Any) -> None:
        extra = caps.pop("extra", {})
        self._caps = PlatformCapabilities(fp8_storage=True, extra=extra, **caps)

    @property
    def capabilities(self) -> PlatformCapabilities:
        return self._caps


@pytest.fixture
def use_platform():
    with switched_platform() as use:
        yield use


def quantize(w: torch.Tensor, per_channel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = (amax / 448.0).float()
    return (w / scale).to(FP8), scale


def cfg(**kw) -> Fp8Config:
    return Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic", **kw})


def test_per_tensor_checkpoint_keeps_fp8_and_matches_reference():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=gen)
    w8, s = quantize(w)
    layer = build_linear(cfg(), "replicated", in_features=128, out_features=96)
    assert isinstance(layer.quant_method, Fp8LinearMethod)
    load_tensors(layer, {"weight": w8, "weight_scale": s})
    finish(layer)
    assert layer.fp8_mode == "call" and layer.weight_fp8.dtype == FP8
    assert_close_to_reference(layer, w8.float() * s, atol=1e-4, rtol=1e-5)
    assert weight_bytes(layer) <= 96 * 128 + 96 * 4  # 1 byte per weight plus row scales


@pytest.mark.parametrize("shape", ["n1", "n"])
def test_per_channel_scales(shape):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 64, generator=gen) * torch.rand(64, 1, generator=gen)
    w8, s = quantize(w, per_channel=True)
    layer = build_linear(cfg(), "replicated", in_features=64, out_features=64)
    load_tensors(layer, {"weight": w8, "weight_scale": s if shape == "n1" else s.flatten()})
    finish(layer)
    assert_close_to_reference(layer, w8.float() * s, atol=1e-4, rtol=1e-5)


def _qkv_checkpoint(seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    sizes = {"q": 64, "k": 32, "v": 32}
    out, ref = {"weight": {}, "weight_scale": {}}, []
    for i, (sid, n) in enumerate(sizes.items()):
        w = torch.randn(n, 64, generator=gen) * (i + 1)  # different per-tensor scales per shard
        w8, s = quantize(w)
        out["weight"][sid], out["weight_scale"][sid] = w8, s
        ref.append(w8.float() * s)
    return out, torch.cat(ref)


def test_merged_per_tensor_scales_are_kept_per_shard():
    tensors, ref = _qkv_checkpoint()
    layer = build_linear(cfg(), "qkv", hidden=64, head=16, heads=4, kv_heads=2, bias=True)
    bias = torch.randn(128)
    load_tensors(layer, {**tensors, "bias": {"q": bias[:64], "k": bias[64:96], "v": bias[96:]}})
    finish(layer)
    assert_close_to_reference(layer, ref, bias=bias, atol=1e-4, rtol=1e-5)


def test_scaled_mm_path_requantizes_merged_shards_to_the_largest_scale(use_platform):
    use_platform(FakeFp8Platform(fp8_compute=True))
    tensors, ref = _qkv_checkpoint()
    layer = build_linear(cfg(), "qkv", hidden=64, head=16, heads=4, kv_heads=2)
    load_tensors(layer, tensors)
    finish(layer)
    assert layer.fp8_mode == "scaled_mm" and layer.fp8_per_tensor
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3))
    y = layer_output(layer, x)
    exact = x @ ref.T
    # Activations are quantized to fp8 (3 mantissa bits): relative error of a few percent.
    assert (y - exact).norm() / exact.norm() < 0.05


def test_scaled_mm_rowwise_with_static_input_scale(use_platform):
    use_platform(FakeFp8Platform(fp8_compute=True))
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(32, 64, generator=gen)
    w8, s = quantize(w, per_channel=True)
    x = torch.randn(5, 64, generator=gen)
    input_scale = (x.abs().amax() / 448.0).reshape(1)
    layer = build_linear(
        cfg(activation_scheme="static"), "replicated", in_features=64, out_features=32
    )
    load_tensors(layer, {"weight": w8, "weight_scale": s, "input_scale": input_scale})
    finish(layer)
    assert layer.fp8_mode == "scaled_mm" and not layer.fp8_per_tensor
    # Independent emulation: activations rounded to fp8 with the static scale, then exact math.
    xq = (x / input_scale).to(FP8).float() * input_scale
    # Rowwise scaled matmuls return bfloat16 (CUDA's only choice): compare at that precision.
    ref = xq @ (w8.float() * s).T
    assert relative_error(layer_output(layer, x), ref) < 4e-3


def test_block_scales_with_ragged_edges():
    gen = torch.Generator().manual_seed(5)
    n, k, bn, bk = 80, 96, 32, 64  # neither dimension a multiple of its block
    w8 = (torch.randn(n, k, generator=gen) * 50).to(FP8)
    s = torch.rand(-(-n // bn), -(-k // bk), generator=gen) + 0.5
    ref = w8.float() * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    layer = build_linear(
        cfg(weight_block_size=[bn, bk]), "replicated", in_features=k, out_features=n
    )
    load_tensors(layer, {"weight": w8, "weight_scale_inv": s})
    finish(layer)
    assert_close_to_reference(layer, ref, atol=1e-3, rtol=1e-5)
    with pytest.raises(
        WeightLoadError, match=r"weight_scale_inv: block scale shape \(2, 2\), expected \(3, 2\)"
    ):
        bad = build_linear(
            cfg(weight_block_size=[bn, bk]), "replicated", in_features=k, out_features=n
        )
        load_tensors(bad, {"weight": w8, "weight_scale_inv": s[:2]})
        finish(bad)


def test_fnuz_platform_reinterprets_bits_exactly(use_platform):
    use_platform(FakeFp8Platform(extra={"fp8_dtype": "float8_e4m3fnuz"}))
    tensors, ref = _qkv_checkpoint(seed=6)
    tensors["weight"]["q"][0, 0] = torch.tensor(-0.0).to(FP8)  # the one pattern that differs
    ref[0, 0] = 0.0
    layer = build_linear(cfg(), "qkv", hidden=64, head=16, heads=4, kv_heads=2)
    load_tensors(layer, tensors)
    finish(layer)
    assert layer.weight_fp8.dtype == torch.float8_e4m3fnuz
    assert not torch.isnan(layer.weight_fp8.float()).any()
    assert_close_to_reference(layer, ref, atol=1e-4, rtol=1e-5)


def test_dequant_at_load_mode(monkeypatch):
    monkeypatch.setenv("LLMHAL_FP8_DEQUANT", "load")
    tensors, ref = _qkv_checkpoint(seed=7)
    layer = build_linear(
        cfg(), "qkv", hidden=64, head=16, heads=4, kv_heads=2, dtype=torch.bfloat16
    )
    load_tensors(layer, tensors)
    finish(layer)
    assert layer.weight_dequant.dtype == torch.bfloat16
    assert_close_to_reference(layer, ref, atol=0.1, rtol=0.02)


def test_online_quantization_per_channel():
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(64, 128, generator=gen) * torch.rand(64, 1, generator=gen)
    assert Fp8Config.is_online()
    layer = build_linear(Fp8Config.online_config(), "merged", in_features=128, out_features=32)
    load_tensors(layer, {"weight": {0: w[:32], 1: w[32:]}})
    finish(layer)
    # fp8 e4m3 keeps 3 mantissa bits: every weight within half a step (2^-4 relative) of w.
    deq = layer.weight_fp8.float() * layer.weight_scale_rows[:, None]
    assert ((deq - w).abs() <= w.abs() * 2**-4 + layer.weight_scale_rows[:, None] * 2**-9).all()
    assert_close_to_reference(layer, deq, atol=1e-4, rtol=1e-5)
    assert weight_bytes(layer) < w.numel() * 4 / 3.5


def test_missing_and_malformed_tensors_name_the_tensor():
    w8, s = quantize(torch.randn(32, 64))
    layer = build_linear(
        cfg(activation_scheme="static"), "replicated", in_features=64, out_features=32
    )
    load_tensors(layer, {"weight": w8, "weight_scale": s})
    with pytest.raises(WeightLoadError, match=r"o_proj\.input_scale \(never loaded\)"):
        finish(layer)
    layer = build_linear(cfg(), "replicated", in_features=64, out_features=32)
    with pytest.raises(WeightLoadError, match=r"o_proj\.weight: checkpoint dtype bfloat16"):
        load_tensors(layer, {"weight": w8.to(torch.bfloat16)})
    load_tensors(layer, {"weight": w8, "weight_scale": torch.ones(5)})
    with pytest.raises(WeightLoadError, match=r"o_proj\.weight_scale: scale shape \(5,\)"):
        finish(layer)
    layer = build_linear(cfg(), "qkv", hidden=64, head=16, heads=4, kv_heads=2)
    tensors, _ = _qkv_checkpoint()
    del tensors["weight_scale"]["v"]
    load_tensors(layer, tensors)
    with pytest.raises(
        WeightLoadError, match=r"qkv_proj\.weight_scale \(shards \['v'\] never loaded\)"
    ):
        finish(layer)


def test_config_parsing_ignored_layers_and_availability():
    c = cfg(activation_scheme="static", ignored_layers=["o_proj"])
    assert c.scheme().static_input_scale and c.is_checkpoint_fp8_serialized
    unq = build_linear(c, "replicated", in_features=64, out_features=32)
    assert type(unq.quant_method).__name__ == "UnquantizedLinearMethod"
    assert isinstance(
        build_linear(c, "lm_head", vocab=64, hidden=32).quant_method, type(unq.quant_method)
    )
    with pytest.raises(ValueError, match="activation_scheme 'weird'"):
        cfg(activation_scheme="weird")
    assert Fp8Config.availability(FakeFp8Platform()) == []
    no_fp8 = FakeFp8Platform()
    no_fp8._caps = PlatformCapabilities(fp8_storage=False)
    (reason,) = Fp8Config.availability(no_fp8)
    assert "cannot store fp8" in reason and "fakefp8" in reason


def test_model_level_greedy_parity(tmp_path):
    from llmhal.testing.quant_models import assert_greedy_parity, write_pair

    def per_tensor(name: str, w: torch.Tensor):
        w8, s = quantize(w)
        return {"weight": w8, "weight_scale": s.reshape(1)}, w8.float() * s

    quant, ref = write_pair(
        tmp_path, per_tensor, {"quant_method": "fp8", "activation_scheme": "dynamic"}
    )
    q_report, ref_report = assert_greedy_parity(quant, ref, logprob_atol=1e-3)
    assert q_report.quantization == "fp8"
    assert q_report.weight_bytes < ref_report.weight_bytes


@pytest.mark.parametrize("dtype", [FP8, torch.float8_e4m3fnuz])
def test_fast_fp8_conversion_is_exact_on_every_code(dtype):
    from llmhal.quantization.fp8 import fp8_to

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    ref = codes.float()
    finite = ~torch.isnan(ref)
    for target in (torch.float32, torch.bfloat16, torch.float16):
        got = fp8_to(codes, target)
        assert got.dtype == target
        assert torch.equal(got.float()[finite], ref[finite])


def test_model_level_online_quantization(tmp_path):
    from llmhal.testing.quant_models import assert_greedy_parity, write_pair

    def reference(name: str, w: torch.Tensor):  # per output channel, amax / 448 (independent)
        w8, s = quantize(w, per_channel=True)
        return {"weight": w}, w8.float() * s

    plain, ref = write_pair(tmp_path, reference, None)
    q_report, ref_report = assert_greedy_parity(plain, ref, logprob_atol=1e-3, quantization="fp8")
    assert q_report.quantization == "fp8"
    assert q_report.weight_bytes < ref_report.weight_bytes / 2


def test_without_fp8_storage_the_advice_respects_the_platforms_allow_list():
    from types import SimpleNamespace

    from llmhal.quantization.fp8 import fp8_availability

    def platform(allowed):
        caps = SimpleNamespace(fp8_storage=False)
        return SimpleNamespace(name="acme", capabilities=caps, supported_quantization=allowed)

    (every,) = fp8_availability(platform(None))
    assert "(gptq, awq, compressed-tensors W8A16)" in every
    (some,) = fp8_availability(platform(("gguf", "gptq", "fp8")))
    assert "use an int8/int4 method (gptq) instead" in some
    (none,) = fp8_availability(platform(("gguf", "fp8")))
    assert "supports no int8/int4 method either (supported here: gguf, fp8)" in none
    assert fp8_availability(SimpleNamespace(capabilities=SimpleNamespace(fp8_storage=True))) == []
