"""AWQ (GEMM version): checkpoints packed in the test from known integer weights.

The packing (AutoAWQ's ``WQLinear_GEMM.from_linear``): the integer weight is laid out [K, N]; each
int32 word ``[k, j]`` takes outputs ``8j ... 8j+7`` in the interleaved order (0, 2, 4, 6, 1, 3, 5, 7):
``qweight[k, j] = sum_i q[k, 8j + order[i]] << (4i)``; ``qzeros`` the same over [K/g, N];
``scales`` [K/g, N] float16. Reference: ``w[n, k] = scales[k//g, n] * (q[k, n] - z[k//g, n])``.
"""

from __future__ import annotations

import pytest
import torch

from llmhal.layers.weights import WeightLoadError
from llmhal.quantization.awq import AWQConfig, AWQLinearMethod
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
from llmhal.testing.quant_models import AWQ_ORDER as ORDER
from llmhal.testing.quant_models import awq_pack, awq_rtn


def make_awq(k, n, g, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // g, n), generator=gen)
    scales = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.001).to(torch.float16)
    tensors = {"qweight": awq_pack(q), "qzeros": awq_pack(z), "scales": scales}
    rows = torch.arange(k) // g
    w = scales.double()[rows] * (q.double() - z.double()[rows])
    return tensors, w.T.contiguous()


def cfg(**kw) -> AWQConfig:
    base = {
        "quant_method": "awq",
        "w_bit": 4,
        "q_group_size": 32,
        "zero_point": True,
        "version": "gemm",
    }
    return AWQConfig.from_config({**base, **kw})


def test_interleaved_order_of_one_word():
    # Outputs 0..7 holding values 0..7: slots hold 0, 2, 4, 6, 1, 3, 5, 7.
    word = awq_pack(torch.arange(8).view(1, 8)).item()
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == list(ORDER)


def test_replicated_layer_matches_reference_and_saves_memory():
    k, n, g = 128, 64, 32
    tensors, w = make_awq(k, n, g)
    layer = build_linear(cfg(), "replicated", in_features=k, out_features=n)
    assert isinstance(layer.quant_method, AWQLinearMethod)
    load_tensors(layer, tensors)
    finish(layer)
    assert_close_to_reference(layer, w, atol=1e-4)
    assert weight_bytes(layer) < k * n * 4 * 0.3
    assert not hasattr(layer, "qweight")  # checkpoint form released after repacking


def test_qkv_shards_and_bias():
    hidden, head, heads, kv = 64, 16, 4, 2
    sizes = {"q": heads * head, "k": kv * head, "v": kv * head}
    parts = {s: make_awq(hidden, sizes[s], 32, seed=i) for i, s in enumerate(sizes)}
    layer = build_linear(
        cfg(), "qkv", hidden=hidden, head=head, heads=heads, kv_heads=kv, bias=True
    )
    bias = {s: torch.randn(sizes[s]) for s in sizes}
    load_tensors(layer, {name: {s: parts[s][0][name] for s in sizes} for name in parts["q"][0]})
    load_tensors(layer, {"bias": bias})
    finish(layer)
    w = torch.cat([parts[s][1] for s in sizes])
    assert_close_to_reference(layer, w, bias=torch.cat(list(bias.values())), atol=1e-4)


def test_bf16_activations():
    tensors, w = make_awq(64, 32, 32, seed=3)
    layer = build_linear(cfg(), "replicated", in_features=64, out_features=32, dtype=torch.bfloat16)
    load_tensors(layer, tensors)
    finish(layer)
    assert_close_to_reference(layer, w, atol=0.05, rtol=0.02)


def test_modules_to_not_convert():
    c = cfg(modules_to_not_convert=["mlp", "o_proj"])
    assert (
        build_linear(c, "merged", in_features=64, out_features=32).quant_method.__class__.__name__
        == "UnquantizedLinearMethod"
    )
    assert (
        build_linear(
            c, "replicated", in_features=64, out_features=32
        ).quant_method.__class__.__name__
        == "UnquantizedLinearMethod"
    )
    assert isinstance(
        build_linear(c, "qkv", hidden=64, head=16, heads=2, kv_heads=1).quant_method,
        AWQLinearMethod,
    )
    with pytest.raises(ValueError, match="quantized differently"):
        build_linear(
            cfg(modules_to_not_convert=["k_proj"]), "qkv", hidden=64, head=16, heads=2, kv_heads=1
        )


def test_missing_and_bad_tensors():
    tensors, _ = make_awq(64, 32, 32)
    layer = build_linear(cfg(), "replicated", in_features=64, out_features=32)
    load_tensors(layer, {"qweight": tensors["qweight"], "scales": tensors["scales"]})
    with pytest.raises(WeightLoadError, match=r"o_proj\.qzeros \(never loaded\)"):
        finish(layer)
    with pytest.raises(WeightLoadError, match=r"o_proj\.scales: .*\(1, 16\)"):
        load_tensors(layer, {"scales": torch.zeros(1, 16)})


def test_unsupported_configs_say_why():
    with pytest.raises(ValueError, match="version 'gemv' is not supported"):
        cfg(version="gemv")
    with pytest.raises(ValueError, match="zero_point: false"):
        cfg(zero_point=False)
    with pytest.raises(ValueError, match="3-bit"):
        cfg(w_bit=3)
    with pytest.raises(ValueError, match="multiples of 8"):
        build_linear(cfg(), "replicated", in_features=64, out_features=12)


def test_platform_kernel():
    tensors, w = make_awq(256, 128, 128, seed=9)
    layer = build_linear(cfg(q_group_size=128), "replicated", in_features=256, out_features=128)
    load_tensors(layer, tensors)
    finish(layer)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(9))
    assert relative_error(layer_output(layer, x), x.double() @ w.T) < 1e-2


def test_model_level_greedy_parity(tmp_path):
    from llmhal.testing.quant_models import assert_greedy_parity, write_pair

    qcfg = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True,
            "version": "gemm"}  # fmt: skip
    quant, ref = write_pair(tmp_path, lambda name, w: awq_rtn(w, 64), qcfg)
    q_report, ref_report = assert_greedy_parity(quant, ref, logprob_atol=1e-3)
    assert q_report.quantization == "awq"
    assert q_report.weight_bytes < ref_report.weight_bytes
