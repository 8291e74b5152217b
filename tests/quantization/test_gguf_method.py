"""The gguf quantization method at layer level: raw GGUF rows in, checked against ``F.linear`` with
the weight dequantized by the gguf package (``gguf.quants.dequantize``).

Exact path (``LLMHAL_GGUF_KERNEL=dequant``): equal to the dequantized linear up to float32 summation
order (1e-5). Fast path (default): the platform's ``quant_linear`` kernel where the format maps onto
it (on CPU: bf16 activations), within 1% relative error; formats it cannot run stay exact.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmhal.layers.weights import WeightLoadError
from llmhal.ops.quant_linear import NativeQuantLinear
from llmhal.quantization.gguf import GGUFConfig, GGUFEmbeddingMethod, GGUFLinearMethod
from llmhal.quantization.gguf_dequant import GGUFRawWeight
from llmhal.quantization.unquantized import UnquantizedLinearMethod
from llmhal.testing.gguf_files import quantized_rows
from llmhal.testing.quant_layers import (
    build_linear,
    finish,
    layer_output,
    load_tensors,
    quant_context,
    relative_error,
    weight_bytes,
)

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
K = 256  # one K-quant super-block per row


def ref_weight(raw: torch.Tensor, name: str) -> torch.Tensor:
    """The gguf package's dequantization (independent of llmhal's)."""
    if raw.is_floating_point():
        return raw.float()
    return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[name]))


def config(**types: str) -> GGUFConfig:
    return GGUFConfig({m.replace("__", "."): t for m, t in types.items()})


def o_proj(t: str, n: int = 64, seed: int = 0, **kw):
    cfg = config(model__layers__0__self_attn__o_proj=t)
    layer = build_linear(cfg, "replicated", in_features=K, out_features=n, **kw)
    raw = quantized_rows(t, n, K, seed=seed)
    load_tensors(layer, {"weight": raw})
    return finish(layer), raw


def x_for(k: int = K, tokens: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def exact(monkeypatch):
    monkeypatch.setenv("LLMHAL_GGUF_KERNEL", "dequant")


@pytest.mark.parametrize("t", TYPES)
def test_exact_path_equals_dequantized_linear(exact, t):
    layer, raw = o_proj(t, seed=TYPES.index(t))
    assert isinstance(layer.quant_method, GGUFLinearMethod)
    x = x_for()
    y = layer_output(layer, x)
    torch.testing.assert_close(y, F.linear(x, ref_weight(raw, t)), rtol=1e-5, atol=1e-5)
    assert layer.quant_method.describe(layer) == f"gguf {t} -> gguf_dequant"
    # the raw blocks are all it holds: exactly the file's bytes, no float copy of the weight
    assert weight_bytes(layer) == raw.numel()
    assert not any(p.is_floating_point() and p.numel() >= 64 * K for p in layer.parameters())


@pytest.mark.parametrize("t", TYPES)
def test_fast_path_within_tolerance(t):
    layer, raw = o_proj(t, seed=20 + TYPES.index(t))
    x = x_for(seed=2)
    ref = x.double() @ ref_weight(raw, t).double().T
    assert relative_error(layer_output(layer, x), ref) < 1e-2
    # Stays quantized: at most 30% above the file's bytes (the kernel's scales in its own layout);
    # 5-bit codes run in 8-bit form (10 bits per weight with scales, vs 5.5-6 in the file).
    assert weight_bytes(layer) <= (1.9 if t.startswith("Q5") else 1.3) * raw.numel()
    from llmhal.ops.registry import get_op

    kernel_cls = get_op("quant_linear")
    ((kernel, _),) = layer.quant_kernels
    if t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):  # always the dispatched quant_linear op
        assert isinstance(kernel, (kernel_cls, NativeQuantLinear))
        assert not isinstance(kernel, GGUFRawWeight)
    else:  # K-quants: the op's kernel where it takes their grouping, else the exact raw rows
        assert isinstance(kernel, (kernel_cls, GGUFRawWeight))


def test_merged_layer_with_mixed_types(exact):
    # Q4_K_M files quantize v (and some down projections) as Q6_K next to Q4_K q/k.
    cfg = config(
        **{f"model__layers__0__self_attn__{x}_proj": t for x, t in zip("qkv", ["Q4_K", "Q4_K", "Q6_K"], strict=True)}
    )  # fmt: skip
    layer = build_linear(cfg, "qkv", hidden=K, head=32, heads=4, kv_heads=2)
    raws = {s: quantized_rows(t, n, K, seed=i) for i, (s, t, n) in enumerate([("q", "Q4_K", 128), ("k", "Q4_K", 64), ("v", "Q6_K", 64)])}  # fmt: skip
    load_tensors(layer, {"weight": raws})
    finish(layer)
    w = torch.cat([ref_weight(raws["q"], "Q4_K"), ref_weight(raws["k"], "Q4_K"), ref_weight(raws["v"], "Q6_K")])  # fmt: skip
    x = x_for()
    torch.testing.assert_close(layer_output(layer, x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert len(layer.quant_kernels) == 2  # q+k joined, v on its own
    assert layer.quant_method.describe(layer) == "gguf Q4_K+Q6_K -> gguf_dequant"


def test_merged_layer_fast_path_and_bias():
    cfg = config(model__layers__0__mlp__gate_proj="Q4_1", model__layers__0__mlp__up_proj="Q8_0")
    layer = build_linear(cfg, "merged", in_features=K, out_features=64, bias=True)
    g, u = quantized_rows("Q4_1", 64, K, seed=1), quantized_rows("Q8_0", 64, K, seed=2)
    bias = torch.randn(128, generator=torch.Generator().manual_seed(3))
    load_tensors(layer, {"weight": {0: g, 1: u}, "bias": {0: bias[:64], 1: bias[64:]}})
    finish(layer)
    w = torch.cat([ref_weight(g, "Q4_1"), ref_weight(u, "Q8_0")])
    x = x_for()
    y = layer_output(layer, x)
    assert relative_error(y, x.double() @ w.double().T + bias.double()) < 1e-2


def test_bf16_model(exact):
    layer, raw = o_proj("Q4_0", dtype=torch.bfloat16)
    x = x_for().bfloat16()
    y = layer_output(layer, x)
    assert y.dtype == torch.bfloat16
    assert relative_error(y, x.double() @ ref_weight(raw, "Q4_0").double().T) < 1e-2


@pytest.mark.parametrize("mode", ["auto", "dequant"])
def test_embedding_lookup_and_tied_lm_head(monkeypatch, mode):
    monkeypatch.setenv("LLMHAL_GGUF_KERNEL", mode)
    from llmhal.layers.vocab_embedding import ParallelLMHead, VocabEmbedding

    cfg = GGUFConfig({"model.embed_tokens": "Q8_0"}, tie_word_embeddings=True)
    vocab, hidden = 256, 64
    raw = quantized_rows("Q8_0", vocab, hidden, seed=4)
    with quant_context(cfg):
        emb = VocabEmbedding(vocab, hidden, prefix="model.embed_tokens")
        head = ParallelLMHead(vocab, hidden, prefix="lm_head")  # no output.weight: tied
    assert isinstance(emb.quant_method, GGUFEmbeddingMethod)
    assert cfg.types_for("lm_head") == cfg.types_for("model.embed_tokens")
    emb.weight.weight_loader(emb.weight, raw)
    finish(emb)
    w = ref_weight(raw, "Q8_0")
    ids = torch.tensor([[3, 255, 3], [0, 17, 200]])
    assert torch.equal(emb(ids), w[ids])  # lookups are always exact
    x = torch.randn(4, hidden, generator=torch.Generator().manual_seed(5))
    logits = emb.logits(x)
    tol = 1e-2 if mode == "auto" else 1e-6
    assert relative_error(logits, x.double() @ w.double().T) < tol
    kernel = emb.quant_kernels[0][0]
    if hasattr(kernel, "embedding"):  # row-addressable (raw rows, native): one copy serves both
        assert emb.gguf_rows is kernel and weight_bytes(emb) == kernel.weight_bytes()
    else:  # an opaque packed layout for the head, the file's rows for lookups
        assert weight_bytes(emb) == kernel.weight_bytes() + raw.numel()
    if mode == "dequant":
        assert weight_bytes(emb) == raw.numel()
    head.weight.weight_loader(head.weight, raw)
    finish(head)
    assert not hasattr(head, "gguf_rows")  # an LM head keeps no lookup rows


def test_float_tensors_are_unquantized():
    cfg = config(model__layers__0__self_attn__o_proj="F16")
    layer = build_linear(cfg, "replicated", in_features=K, out_features=32)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    w = quantized_rows("F16", 32, K)
    load_tensors(layer, {"weight": w})
    assert torch.equal(layer.weight, w.float())


def test_loading_errors_name_the_tensor():
    cfg = config(model__layers__0__self_attn__o_proj="Q4_K")
    layer = build_linear(cfg, "replicated", in_features=K, out_features=32)
    good = quantized_rows("Q4_K", 32, K)
    with pytest.raises(WeightLoadError, match=r"o_proj: checkpoint shape \(32, 160\).*\(32, 144\).*Q4_K rows of 144 bytes for K=256"):  # fmt: skip
        load_tensors(layer, {"weight": torch.zeros(32, 160, dtype=torch.uint8)})
    with pytest.raises(WeightLoadError, match="o_proj is Q4_K in the GGUF file and expects raw uint8 rows"):  # fmt: skip
        load_tensors(layer, {"weight": torch.zeros(32, K)})
    with pytest.raises(WeightLoadError, match=r"unknown shard 'q'"):
        load_tensors(layer, {"weight": {"q": good}})

    qkv = build_linear(config(**{f"model__layers__0__self_attn__{x}_proj": "Q8_0" for x in "qkv"}), "qkv", hidden=K, head=32, heads=2, kv_heads=1)  # fmt: skip
    load_tensors(qkv, {"weight": {"q": quantized_rows("Q8_0", 64, K), "v": quantized_rows("Q8_0", 32, K)}})  # fmt: skip
    with pytest.raises(WeightLoadError, match=r"qkv_proj.weight \(shards \['k'\] never loaded\)"):
        finish(qkv)


def test_config_errors():
    with pytest.raises(ValueError, match=r"GGUF tensor model.layers.0.mlp.up_proj.weight: GGUF tensor type 16 is not supported"):  # fmt: skip
        GGUFConfig({"model.layers.0.mlp.up_proj": 16})
    cfg = config(model__layers__0__mlp__gate_proj="Q4_0")
    with pytest.raises(ValueError, match=r"merges .* no tensor for model.layers.0.mlp.up_proj.weight"):  # fmt: skip
        build_linear(cfg, "merged", in_features=K, out_features=32)
    with pytest.raises(ValueError, match="not a whole number of Q4_K blocks"):
        build_linear(config(model__layers__0__self_attn__o_proj="Q4_K"), "replicated", in_features=96, out_features=32)  # fmt: skip
    with pytest.raises(ValueError, match="comes from the .gguf file itself"):
        GGUFConfig.from_config({})
    assert GGUFConfig.from_config({"tensor_types": {"lm_head": 8}}).tensor_types["lm_head"].name == "Q8_0"  # fmt: skip


def test_unknown_kernel_mode(monkeypatch):
    monkeypatch.setenv("LLMHAL_GGUF_KERNEL", "fastest")
    with pytest.raises(ValueError, match="LLMHAL_GGUF_KERNEL='fastest'.*auto, dequant"):
        o_proj("Q4_0")


def test_grouped_parts_are_exact():
    cfg = config(**{f"model__layers__0__self_attn__{x}_proj": t for x, t in zip("qkv", ["Q4_1", "Q4_1", "Q5_K"], strict=True)})  # fmt: skip
    layer = build_linear(cfg, "qkv", hidden=K, head=32, heads=2, kv_heads=1)
    raws = {"q": quantized_rows("Q4_1", 64, K, 1), "k": quantized_rows("Q4_1", 32, K, 2), "v": quantized_rows("Q5_K", 32, K, 3)}  # fmt: skip
    load_tensors(layer, {"weight": raws})
    parts = layer.quant_method.grouped_parts(layer)
    assert [p.weight.bits for p in parts] == [4, 8]
    got = torch.cat([p.weight.dequantize() for p in parts])
    want = torch.cat([ref_weight(raws["q"], "Q4_1"), ref_weight(raws["k"], "Q4_1"), ref_weight(raws["v"], "Q5_K")])  # fmt: skip
    assert torch.equal(got, want)
    assert np.isfinite(got.numpy()).all()
