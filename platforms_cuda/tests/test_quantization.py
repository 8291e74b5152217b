"""CUDA quantization methods: registration, validation and error text on any machine (platforms
built from fake NVML inventories); numerics on CPU tensors through the paths that do not need a GPU;
the GPU kernels themselves in tests marked ``gpu``."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from llmhal.platforms import get_current_platform
from llmhal.quantization.base import QuantizationConfig
from llmhal.testing.isolation import switched_platform
from llmhal.testing.quant_layers import (
    assert_close_to_reference,
    build_linear,
    exact_quant_kernel,  # noqa: F401 (autouse fixture)
    finish,
    layer_output,
    load_tensors,
    relative_error,
)
from llmhal.testing.signatures import bound_to
from llmhal.utils.imports import resolve_obj_by_qualname
from llmhal_cuda import upstream_api
from llmhal_cuda.platform import CudaPlatform
from llmhal_cuda.quantization.awq_marlin import AWQMarlinConfig
from llmhal_cuda.quantization.fbgemm_fp8 import FBGEMMFp8Config, FBGEMMFp8LinearMethod
from llmhal_cuda.quantization.gptq_marlin import GPTQMarlinConfig, GPTQMarlinLinearMethod
from llmhal_cuda.quantization.modelopt import ModelOptConfig, NvFp4LinearMethod

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
AWQ = {
    "quant_method": "awq",
    "w_bit": 4,
    "q_group_size": 128,
    "zero_point": True,
    "version": "gemm",
}


@pytest.fixture
def on_gpu(fake_inventory, gpus):
    """``on_gpu("H100")`` makes a CudaPlatform over that fake GPU the active platform."""
    with switched_platform() as use:
        yield lambda name: use(CudaPlatform(fake_inventory(getattr(gpus, name))))


def test_declared_methods_resolve_to_their_configs():
    for name, path in CudaPlatform.quantization_methods.items():
        cls = resolve_obj_by_qualname(path)
        assert issubclass(cls, QuantizationConfig) and cls.get_name() == name


def test_marlin_methods_claim_gptq_and_awq_on_ampere_and_newer(on_gpu):
    on_gpu("H100")
    assert GPTQMarlinConfig.override_quantization_method(GPTQ, None) == "gptq_marlin"
    assert AWQMarlinConfig.override_quantization_method(AWQ, None) == "awq_marlin"
    # The user's explicit choice of the plain method, other formats and odd groups are left alone.
    assert GPTQMarlinConfig.override_quantization_method(GPTQ, "gptq") is None
    assert GPTQMarlinConfig.override_quantization_method({**GPTQ, "bits": 8}, None) is None
    assert GPTQMarlinConfig.override_quantization_method({**GPTQ, "group_size": 48}, None) is None
    assert AWQMarlinConfig.override_quantization_method({**AWQ, "version": "gemv"}, None) is None
    assert AWQMarlinConfig.override_quantization_method(GPTQ, None) is None
    on_gpu("T4")
    assert GPTQMarlinConfig.override_quantization_method(GPTQ, None) is None
    (reason,) = GPTQMarlinConfig.availability(get_current_platform())
    assert reason == "needs compute capability >= 8.0 (this GPU: 7.5)"


def test_not_claimed_on_the_cpu_platform_and_reasons_say_why():
    cpu = get_current_platform()
    assert GPTQMarlinConfig.override_quantization_method(GPTQ, None) is None
    assert "needs an NVIDIA GPU; the active platform is cpu" in AWQMarlinConfig.availability(cpu)
    assert any("runs on NVIDIA GPUs" in r for r in FBGEMMFp8Config.availability(cpu))


def test_resolution_picks_gptq_marlin_on_a_gpu(on_gpu):
    from llmhal.quantization.resolve import resolve_quantization

    platform = on_gpu("A100")
    name, config = resolve_quantization(
        "gptq", GPTQ, None, platform, torch.bfloat16, lambda cls: cls.from_config(GPTQ)
    )
    assert name == "gptq_marlin" and isinstance(config, GPTQMarlinConfig)
    with pytest.raises(ValueError, match="activation dtype float32 not supported"):
        resolve_quantization(
            "gptq", GPTQ, "gptq_marlin", platform, torch.float32, lambda c: c.from_config(GPTQ)
        )


def _pack(values: torch.Tensor, dim: int) -> torch.Tensor:
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    word = sum(v[..., j] << (4 * j) for j in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).movedim(-1, dim)


def test_gptq_marlin_layer_on_cpu_tensors_falls_back_exactly(on_gpu):
    on_gpu("H100")
    k, n, g = 256, 64, 128
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (k, n), generator=gen)
    scales = torch.rand(k // g, n, generator=gen).half() * 0.01
    tensors = {
        "qweight": _pack(q, 0).contiguous(),
        "qzeros": _pack(torch.full((k // g, n), 7), 1).contiguous(),
        "scales": scales,
        "g_idx": (torch.arange(k) // g).int(),
    }
    layer = build_linear(
        GPTQMarlinConfig.from_config(GPTQ), "replicated", in_features=k, out_features=n
    )
    assert isinstance(layer.quant_method, GPTQMarlinLinearMethod)
    load_tensors(layer, tensors)
    finish(layer)
    # The tensors are on the CPU, so tinygemm declines and the platform kernel runs the weight.
    assert layer.quant_kernels[0][0].name != "tinygemm_int4"
    w = (scales.double()[torch.arange(k) // g] * (q.double() - 8)).T
    assert_close_to_reference(layer, w, atol=1e-4)


def test_fbgemm_fp8_bounds_the_activation_scale(on_gpu):
    on_gpu("H100")  # fp8 matmuls: torch._scaled_mm (runs on CPU tensors too)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=gen)
    ws = w.abs().amax(dim=1, keepdim=True) / 448
    w8 = (w / ws).to(torch.float8_e4m3fn)
    cfg = FBGEMMFp8Config.from_config(
        {"quant_method": "fbgemm_fp8", "activation_scale_ub": 2.0, "modules_to_not_convert": []}
    )
    layer = build_linear(cfg, "replicated", in_features=128, out_features=64)
    assert isinstance(layer.quant_method, FBGEMMFp8LinearMethod)
    load_tensors(layer, {"weight": w8, "weight_scale": ws})
    finish(layer)
    assert layer.fp8_mode == "scaled_mm" and not layer.fbgemm_rowwise
    x = torch.randn(3, 128, generator=gen)
    x[0, 0] = 50.0  # far above the bound: saturates instead of stretching the scale
    sx = x.abs().amax(dim=1, keepdim=True).clamp(max=2.0) / 448
    xq = (x / sx).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sx
    # Rowwise scaled matmuls return bfloat16 (CUDA's only choice): compare at that precision.
    ref = xq @ (w8.float() * ws).T
    assert relative_error(layer_output(layer, x), ref) < 4e-3
    with pytest.raises(ValueError, match="activation_scale_ub"):
        FBGEMMFp8Config.from_config({"quant_method": "fbgemm_fp8"})


def _fake_fbgemm_ops(calls: list) -> types.SimpleNamespace:
    """torch.ops.fbgemm's two fp8 ops, called like their schemas. fbgemm-gpu-genai 1.6.0's
    quantize kernel reads the input pointer as contiguous bf16 whatever its dtype, so the stand-in
    refuses anything else (the real one would quantize garbage)."""

    @bound_to(upstream_api.quantize_fp8_per_row)
    def quantize_fp8_per_row(a):
        x = a["input"]
        if x.dtype != torch.bfloat16 or not x.is_contiguous():
            raise AssertionError(f"kernel reads contiguous bf16; got {x.dtype}, {x.stride()}")
        calls.append("quantize")
        amax = x.float().abs().amax(dim=1).clamp(max=float(a["scale_ub"]))
        scale = (amax / 448).clamp(min=1e-12)
        return [(x.float() / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale]

    @bound_to(upstream_api.f8f8bf16_rowwise)
    def f8f8bf16_rowwise(a):
        x = a["XQ"].float() * a["x_scale"][:, None]
        w = a["WQ"].float() * a["w_scale"].reshape(-1, 1)
        return (x @ w.T).to(torch.bfloat16)

    return types.SimpleNamespace(
        quantize_fp8_per_row=quantize_fp8_per_row, f8f8bf16_rowwise=f8f8bf16_rowwise
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fbgemm_rowwise_gets_contiguous_bf16_activations(on_gpu, monkeypatch, dtype):
    on_gpu("H100")
    calls: list[str] = []
    monkeypatch.setattr(torch.ops, "fbgemm", _fake_fbgemm_ops(calls), raising=False)
    for name in ("fbgemm_gpu", "fbgemm_gpu.experimental", "fbgemm_gpu.experimental.gen_ai"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(64, 128, generator=gen)
    ws = w.abs().amax(dim=1, keepdim=True) / 448
    w8 = (w / ws).to(torch.float8_e4m3fn)
    layer = build_linear(FBGEMMFp8Config(None, 8.0), "replicated", in_features=128,
                         out_features=64, dtype=dtype)  # fmt: skip
    load_tensors(layer, {"weight": w8, "weight_scale": ws})
    finish(layer)
    # The weights are on the CPU here: switch the layer to the GPU path by hand.
    layer.fbgemm_rowwise = True
    layer.register_buffer("fbgemm_scale_ub", torch.tensor(8.0))
    x = torch.randn(3, 256, generator=gen).to(dtype)[:, ::2]  # strided, as a sliced activation
    y = layer_output(layer, x)
    assert calls == ["quantize"] and y.dtype == dtype
    xb = x.to(torch.bfloat16).float()  # what FBGEMM quantizes
    sx = xb.abs().amax(dim=1, keepdim=True).clamp(max=8.0) / 448
    xq = (xb / sx).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sx
    assert relative_error(y, xq @ (w8.float() * ws).T) < 4e-3  # bf16 output


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tinygemm_gets_a_contiguous_bf16_input(monkeypatch, dtype):
    from llmhal_cuda.quantization.int4_tinygemm import TinygemmInt4Linear

    def int4pack_mm(a, b, group_size, scales_and_zeros):  # aten's CUDA checks
        assert a.dtype == torch.bfloat16, a.dtype
        assert a.is_contiguous(), "A must be contiguous"
        return torch.zeros(a.shape[0], 16, dtype=torch.bfloat16)

    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm", int4pack_mm)
    kernel = object.__new__(TinygemmInt4Linear)  # the packing needs a GPU; the call does not
    kernel.shape, kernel.group_size = (16, 64), 32
    kernel.packed = kernel.scales_and_zeros = None
    x = torch.randn(3, 128).to(dtype)[:, ::2]
    y = kernel(x)
    assert y.shape == (3, 16) and y.dtype == dtype


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_modelopt_nvfp4_matches_a_direct_dequantization():
    n, k = 48, 64
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)  # even element: low nibble
    block = (torch.rand(n, k // 16, generator=gen) + 0.25).to(torch.float8_e4m3fn)
    global_scale = torch.tensor(0.02)
    w = torch.tensor(E2M1, dtype=torch.float64)[codes]
    w = w * block.double().repeat_interleave(16, dim=1) * 0.02
    cfg = ModelOptConfig.from_config(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                             "exclude_modules": ["lm_head"]}}
    )  # fmt: skip
    layer = build_linear(cfg, "replicated", in_features=k, out_features=n)
    assert isinstance(layer.quant_method, NvFp4LinearMethod)
    load_tensors(
        layer,
        {"weight": packed, "weight_scale": block, "weight_scale_2": global_scale,
         "input_scale": torch.tensor(0.5)},
    )  # fmt: skip
    finish(layer)
    assert_close_to_reference(layer, w, atol=1e-4, rtol=1e-5)
    assert layer.quant_method.weight_bytes(layer) < n * k * 4 * 0.2


def test_modelopt_fp8_and_config_errors():
    cfg = ModelOptConfig.from_config({"quant_method": "modelopt", "quant_algo": "FP8",
                                      "exclude_modules": ["*.mlp.*"]})  # fmt: skip
    gate_up = build_linear(cfg, "merged", in_features=64, out_features=32)
    assert type(gate_up.quant_method).__name__ == "UnquantizedLinearMethod"
    qkv = build_linear(cfg, "qkv", hidden=64, head=16, heads=2, kv_heads=1)
    assert qkv.quant_method.scheme.static_input_scale
    with pytest.raises(ValueError, match="quant_algo 'INT4_AWQ' is not supported"):
        ModelOptConfig.from_config({"quant_algo": "INT4_AWQ"})
    assert ModelOptConfig.get_config_filenames() == ["hf_quant_config.json"]


def _cuda() -> bool:
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_tinygemm_kernel_matches_the_grouped_definition():
    from llmhal.ops.quant_linear import GroupedQuantWeight
    from llmhal_cuda.quantization.int4_tinygemm import TinygemmInt4Linear

    gen = torch.Generator().manual_seed(3)
    n, k, g = 256, 512, 128
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // g, generator=gen) * 0.01
    offset = -torch.randint(0, 16, (n, k // g), generator=gen).float() * scale
    weight = GroupedQuantWeight(q.cuda(), scale.cuda(), offset.cuda(), g, 4)
    kernel = TinygemmInt4Linear(weight, torch.bfloat16)
    x = torch.randn(8, k, generator=gen).cuda().bfloat16()
    ref = x.float() @ weight.dequantize().T
    rel = (kernel(x).float() - ref).norm() / ref.norm()
    assert rel < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_fbgemm_rowwise_on_gpu():
    pytest.importorskip("fbgemm_gpu")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FBGEMM's f8f8bf16_rowwise needs Hopper or newer")
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(256, 512, generator=gen)
    ws = w.abs().amax(dim=1, keepdim=True) / 448
    w8 = (w / ws).to(torch.float8_e4m3fn)
    cfg = FBGEMMFp8Config(None, 1200.0)
    with torch.device("cuda"):
        layer = build_linear(
            cfg, "replicated", in_features=512, out_features=256, dtype=torch.bfloat16
        )
    load_tensors(layer, {"weight": w8.cuda(), "weight_scale": ws.cuda()})
    finish(layer)
    x = torch.randn(4, 512, generator=gen).cuda().bfloat16()
    ref = x.float() @ (w8.float() * ws).cuda().T
    assert (layer_output(layer, x).float() - ref).norm() / ref.norm() < 2e-2


def _resolve(platform, user, cfg=AWQ, dtype=torch.bfloat16):
    from llmhal.quantization.resolve import resolve_quantization

    method = cfg["quant_method"]
    return resolve_quantization(method, cfg, user, platform, dtype, lambda c: c.from_config(cfg))


def test_awq_marlin_is_an_override_for_awq_checkpoints(on_gpu):
    from llmhal.quantization.resolve import QuantizationError

    name, config = _resolve(on_gpu("H100"), "awq_marlin")
    assert name == "awq_marlin" and isinstance(config, AWQMarlinConfig)
    # On a GPU the kernel cannot serve, the override stands and the error says what it needs.
    with pytest.raises(QuantizationError, match=r"needs compute capability >= 8\.0"):
        _resolve(on_gpu("T4"), "awq_marlin")
    # A method of another format is still a conflict.
    with pytest.raises(QuantizationError, match="quantized with 'awq', but quantization='gptq'"):
        _resolve(on_gpu("H100"), "gptq")


def test_awq_marlin_on_the_cpu_says_it_needs_a_cuda_platform():
    from llmhal.quantization.resolve import QuantizationError

    cpu = get_current_platform()
    if cpu.name == "cuda":
        pytest.skip("checks the message off the cuda platform")
    with pytest.raises(QuantizationError) as err:
        _resolve(cpu, "awq_marlin")
    msg = str(err.value)
    assert "quantization='awq_marlin' is the cuda platform's kernel for 'awq' checkpoints" in msg
    assert f"this is the {cpu.name} platform" in msg and "Drop the quantization argument" in msg
