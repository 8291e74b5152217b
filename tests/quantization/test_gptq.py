"""GPTQ: checkpoints packed in the test from known integer weights, checked against a direct
dequantization written here (not llmhal's code path).

The packing (AutoGPTQ/GPTQModel layout): with ``per = 32 // bits``,
``qweight[i, n] = sum_j q[per*i + j, n] << (bits*j)`` (int32, two's complement),
``qzeros[gi, j] = sum_t zs[gi, per*j + t] << (bits*t)`` where ``zs = z - 1`` for format "gptq" (v1)
and ``zs = z`` for "gptq_v2"; ``scales`` [K/g, N] float16; ``g_idx[k]`` = group of input column k.
Reference: ``w[n, k] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])``.
"""

from __future__ import annotations

import pytest
import torch

from llmhal.layers.weights import WeightLoadError
from llmhal.quantization.gptq import GPTQConfig, GPTQLinearMethod
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


def pack_along(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit integers ``per`` at a time along ``dim`` into int32 words."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for j in range(per):
        word |= (v[..., j] & ((1 << bits) - 1)) << (bits * j)
    word = torch.where(word >= 2**31, word - 2**32, word)  # reinterpret as signed int32
    return word.to(torch.int32).movedim(-1, dim).contiguous()


def make_gptq(k, n, g, bits=4, fmt="gptq", sym=True, act_order=False, seed=0):
    """Known weights -> (checkpoint tensors, reference weight [N, K] float64)."""
    gen = torch.Generator().manual_seed(seed)
    qmax = (1 << bits) - 1
    groups = k // g
    q = torch.randint(0, qmax + 1, (k, n), generator=gen)
    if sym:
        z = torch.full((groups, n), 1 << (bits - 1))
    else:  # v1 cannot store z = 0 (it stores z - 1 unsigned), so stay within [1, qmax]
        z = torch.randint(1, qmax + 1, (groups, n), generator=gen)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).to(torch.float16)
    if act_order:
        perm = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // g).to(torch.int32)
    stored_z = z - 1 if fmt == "gptq" else z
    tensors = {
        "qweight": pack_along(q, bits, 0),
        "qzeros": pack_along(stored_z, bits, 1),
        "scales": scales,
        "g_idx": g_idx,
    }
    gi = g_idx.long()
    w = scales.double()[gi, :] * (q.double() - z.double()[gi, :])  # [K, N]
    return tensors, w.T.contiguous()


def cfg(**kw) -> GPTQConfig:
    base = {"bits": 4, "group_size": 32, "desc_act": False, "sym": True, "quant_method": "gptq"}
    return GPTQConfig.from_config({**base, **kw})


def test_pack_helper_roundtrip_matches_the_documented_layout():
    # One word, values 1..8 in slots 0..7: 0x87654321.
    word = pack_along(torch.arange(1, 9).view(8, 1), 4, 0)
    assert word.item() == 0x87654321 - 2**32


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [True, False])
def test_replicated_layer_matches_reference(fmt, sym):
    k, n, g = 128, 96, 32
    tensors, w = make_gptq(k, n, g, fmt=fmt, sym=sym)
    layer = build_linear(
        cfg(checkpoint_format=fmt, sym=sym), "replicated", in_features=k, out_features=n
    )
    assert isinstance(layer.quant_method, GPTQLinearMethod)
    load_tensors(layer, tensors)
    finish(layer)
    assert_close_to_reference(layer, w, atol=1e-4)
    dense = k * n * 4
    assert weight_bytes(layer) < dense * 0.3  # int4 + per-group fp32 scale/offset


def test_qkv_act_order_shards_share_one_permutation():
    hidden, head, heads, kv = 128, 16, 4, 2
    sizes = {"q": heads * head, "k": kv * head, "v": kv * head}
    parts = {s: make_gptq(hidden, sizes[s], 32, act_order=True, seed=1) for s in sizes}
    # GPTQ's act order comes from the shared input's Hessian: q, k and v have the same g_idx.
    gi = parts["q"][0]["g_idx"]
    for s in sizes:
        parts[s] = make_gptq(hidden, sizes[s], 32, seed=ord(s))
        parts[s][0]["g_idx"] = gi
    refs = {}
    for s in sizes:
        t, _ = parts[s]
        q = torch.stack([(t["qweight"] >> (4 * j)) & 0xF for j in range(8)], 1).reshape(hidden, -1)
        z = torch.stack([(t["qzeros"] >> (4 * j)) & 0xF for j in range(8)], 2).reshape(4, -1) + 1
        refs[s] = (t["scales"].double()[gi.long()] * (q.double() - z.double()[gi.long()])).T
    layer = build_linear(
        cfg(desc_act=True), "qkv", hidden=hidden, head=head, heads=heads, kv_heads=kv
    )
    load_tensors(layer, {name: {s: parts[s][0][name] for s in sizes} for name in parts["q"][0]})
    finish(layer)
    assert len(layer.quant_kernels) == 1 and layer.quant_kernels[0][1] is not None
    assert_close_to_reference(layer, torch.cat([refs[s] for s in sizes]), atol=1e-4)


def test_merged_shards_with_different_act_orders_get_their_own_kernels():
    k, n = 64, 32
    shards = [make_gptq(k, n, 16, act_order=True, seed=s) for s in (3, 4)]
    layer = build_linear(cfg(desc_act=True, group_size=16), "merged", in_features=k, out_features=n)
    load_tensors(layer, {name: {i: shards[i][0][name] for i in (0, 1)} for name in shards[0][0]})
    finish(layer)
    assert len(layer.quant_kernels) == 2
    assert_close_to_reference(layer, torch.cat([shards[0][1], shards[1][1]]), atol=1e-4)


def test_eight_bit_symmetric_and_asymmetric():
    k, n, g = 64, 32, 32
    for sym in (True, False):
        tensors, w = make_gptq(k, n, g, bits=8, sym=sym, seed=5)
        layer = build_linear(
            cfg(bits=8, group_size=g, sym=sym), "replicated", in_features=k, out_features=n
        )
        load_tensors(layer, tensors)
        finish(layer)
        assert_close_to_reference(layer, w, atol=2e-3)


def test_per_channel_group_size_minus_one_and_bf16_activations():
    k, n = 64, 48
    tensors, w = make_gptq(k, n, k, seed=6)
    layer = build_linear(
        cfg(group_size=-1), "replicated", in_features=k, out_features=n, dtype=torch.bfloat16
    )
    load_tensors(layer, tensors)
    finish(layer)
    assert_close_to_reference(layer, w, atol=0.05, rtol=0.02)


def test_uneven_groups_fall_back_to_an_exact_dense_weight():
    k, n, g = 64, 16, 16
    tensors, _ = make_gptq(k, n, g, seed=7)
    gen = torch.Generator().manual_seed(7)
    g_idx = torch.randint(0, k // g, (k,), generator=gen, dtype=torch.int32)
    tensors["g_idx"] = g_idx
    q = torch.stack([(tensors["qweight"] >> (4 * j)) & 0xF for j in range(8)], 1).reshape(k, n)
    w = (tensors["scales"].double()[g_idx.long()] * (q.double() - 8)).T
    layer = build_linear(
        cfg(group_size=g, desc_act=True), "replicated", in_features=k, out_features=n
    )
    load_tensors(layer, tensors)
    finish(layer)
    assert layer.quant_kernels[0][0].name == "dense"
    assert_close_to_reference(layer, w, atol=1e-4)


def test_missing_scales_are_reported_by_name():
    tensors, _ = make_gptq(64, 32, 32)
    del tensors["scales"]
    layer = build_linear(cfg(), "replicated", in_features=64, out_features=32)
    load_tensors(layer, tensors)
    with pytest.raises(WeightLoadError, match=r"o_proj\.scales \(never loaded\)"):
        finish(layer)


def test_missing_shard_is_reported_by_name():
    tensors, _ = make_gptq(64, 32, 32)
    layer = build_linear(cfg(), "merged", in_features=64, out_features=32)
    load_tensors(layer, {name: {0: t} for name, t in tensors.items()})
    with pytest.raises(WeightLoadError, match=r"gate_up_proj\.qweight \(shards \['1'\]"):
        finish(layer)


def test_wrong_shape_and_dtype_name_the_tensor():
    tensors, _ = make_gptq(64, 32, 32)
    layer = build_linear(cfg(), "replicated", in_features=64, out_features=32)
    with pytest.raises(WeightLoadError, match=r"o_proj\.qweight: .*\(16, 32\)"):
        load_tensors(layer, {"qweight": torch.zeros(16, 32, dtype=torch.int32)})
    with pytest.raises(WeightLoadError, match=r"o_proj\.qzeros: checkpoint dtype float32"):
        load_tensors(layer, {"qzeros": tensors["qzeros"].float()})
    with pytest.raises(WeightLoadError, match=r"g_idx.*\(32,\)"):
        load_tensors(layer, {**tensors, "g_idx": torch.zeros(32, dtype=torch.int32)})
        finish(layer)


def test_config_parsing_and_errors():
    c = cfg(checkpoint_format="gptq_v2", lm_head=True)
    assert (c.bits, c.group_size, c.checkpoint_format, c.lm_head) == (4, 32, "gptq_v2", True)
    assert (
        GPTQConfig.from_config(
            {"bits": 4, "group_size": 128, "format": "GPTQ_V2"}
        ).checkpoint_format
        == "gptq_v2"
    )
    with pytest.raises(ValueError, match="bits=3 is not supported"):
        cfg(bits=3)
    with pytest.raises(ValueError, match="Cannot find any of"):
        GPTQConfig.from_config({"bits": 4})
    with pytest.raises(ValueError, match="multiple of the group size"):
        build_linear(cfg(group_size=48), "replicated", in_features=64, out_features=32)


def test_dynamic_exclusion_and_lm_head():
    c = cfg(dynamic={r"-:.*\.mlp\..*": {}}, lm_head=True)
    assert (
        build_linear(c, "merged", in_features=64, out_features=32).quant_method.__class__.__name__
        == "UnquantizedLinearMethod"
    )
    assert isinstance(
        build_linear(c, "qkv", hidden=64, head=16, heads=2, kv_heads=1).quant_method,
        GPTQLinearMethod,
    )
    head = build_linear(c, "lm_head", vocab=64, hidden=64)
    assert isinstance(head.quant_method, GPTQLinearMethod)
    tensors, w = make_gptq(64, 64, 32)
    load_tensors(head, tensors)
    finish(head)
    assert_close_to_reference(head, w, atol=1e-4)
    assert (
        build_linear(cfg(), "lm_head", vocab=64, hidden=64).quant_method.__class__.__name__
        == "UnquantizedLinearMethod"
    )


def test_act_order_platform_kernel():
    # Whatever quant_linear kernel the platform provides (on CPU: int4pack with bf16 activations).
    k, n, g = 256, 128, 64
    tensors, w = make_gptq(k, n, g, act_order=True, seed=9)
    layer = build_linear(
        cfg(group_size=g, desc_act=True), "replicated", in_features=k, out_features=n
    )
    load_tensors(layer, tensors)
    finish(layer)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(9))
    assert relative_error(layer_output(layer, x), x.double() @ w.T) < 1e-2


def gptq_rtn(w: torch.Tensor, g: int, *, sym: bool, fmt: str, act_order: bool, seed: int = 0):
    """Round-to-nearest GPTQ-format quantization of w [N, K] (what GPTQ stores, without its
    error compensation), packed as documented at the top of this file."""
    n, k = w.shape
    maxq = 15
    if act_order:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // g
    else:
        g_idx = torch.arange(k) // g
    groups = k // g
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for t in range(groups):
        cols = w[:, g_idx == t]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            scales[t] = (2 * torch.maximum(lo.abs(), hi) / maxq).clamp(min=1e-8)
            zeros[t] = 8
        else:
            scales[t] = ((hi - lo) / maxq).clamp(min=1e-8)
            zeros[t] = torch.round(-lo / scales[t]).long()
    scales = scales.to(torch.float16)
    s_k, z_k = scales.float()[g_idx].T, zeros[g_idx].T  # per element [N, K]
    q = torch.clamp(torch.round(w / s_k) + z_k, 0, maxq).long()
    deq = (q - z_k).double() * s_k.double()
    stored = zeros - 1 if fmt == "gptq" else zeros
    tensors = {
        "qweight": pack_along(q.T, 4, 0),
        "qzeros": pack_along(stored, 4, 1),
        "scales": scales,
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, deq


@pytest.mark.parametrize(
    ("sym", "fmt", "act_order"), [(True, "gptq", False), (False, "gptq_v2", True)]
)
def test_model_level_greedy_parity(tmp_path, sym, fmt, act_order):
    from llmhal.testing.quant_models import assert_greedy_parity, write_pair

    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": act_order,
            "sym": sym, "checkpoint_format": fmt}  # fmt: skip
    quant, ref = write_pair(
        tmp_path,
        lambda name, w: gptq_rtn(w, 64, sym=sym, fmt=fmt, act_order=act_order, seed=len(name)),
        qcfg,
    )
    q_report, ref_report = assert_greedy_parity(quant, ref, logprob_atol=1e-3)
    assert q_report.quantization == "gptq"
    assert q_report.weight_bytes < ref_report.weight_bytes


def test_dynamic_overrides_per_module():
    # GPTQModel's "dynamic": a "+:" regex changes settings for the modules it matches.
    c = cfg(group_size=32, dynamic={r"+:.*\.mlp\..*": {"bits": 8, "group_size": 64}})
    mlp = build_linear(c, "merged", in_features=128, out_features=32)
    attn = build_linear(c, "replicated", in_features=128, out_features=32)
    assert (mlp.quant_method.bits, mlp.gptq_group_size) == (8, 64)
    assert (attn.quant_method.bits, attn.gptq_group_size) == (4, 32)
    tensors, w = make_gptq(128, 32, 64, bits=8, seed=11)
    load_tensors(mlp, {n: {0: t, 1: t} for n, t in tensors.items()})
    finish(mlp)
    assert_close_to_reference(mlp, torch.cat([w, w]), atol=2e-3)
