"""Parallel layers on two ranks (gloo, spawned processes) equal their single-process versions.

Each rank builds the replicated layer and the parallel one from the same checkpoint tensors (the
whole tensors: the parallel layer's loaders cut the rank's part) and compares outputs; one spawn
runs every check and the tests read its results. Quantized layers (GPTQ, AWQ, fp8, GGUF) are
compared with the replicated layer of the same method, whose own tests compare it with the
dequantized weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from llmhal.distributed.launch import run_ranks

H, K, N, V = 64, 128, 64, 385  # V: not divisible by 2 (the last rank's rows are padding)


def _x(k: int, tokens: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed))


def _load(layer: Any, tensors: dict[str, Any], finish: bool = True) -> Any:
    from llmhal.testing.quant_layers import finish as finish_layer
    from llmhal.testing.quant_layers import load_tensors

    load_tensors(layer, tensors)
    return finish_layer(layer) if finish else layer


def _gptq_tensors(k: int, n: int, g: int, seed: int, act_order: bool = False) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    words = lambda *s: torch.randint(-(2**31), 2**31 - 1, s, generator=gen, dtype=torch.int64)  # noqa: E731
    g_idx = torch.arange(k, dtype=torch.int32) // g
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return {
        "qweight": words(k // 8, n).to(torch.int32),
        "qzeros": words(k // g, n // 8).to(torch.int32),
        "scales": (torch.rand(k // g, n, generator=gen) * 0.02 + 0.001).to(torch.float16),
        "g_idx": g_idx,
    }


def _awq_tensors(k: int, n: int, g: int, seed: int) -> dict[str, Any]:
    t = _gptq_tensors(k, n, g, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    words = torch.randint(-(2**31), 2**31 - 1, (k, n // 8), generator=gen, dtype=torch.int64)
    return {"qweight": words.to(torch.int32), "qzeros": t["qzeros"], "scales": t["scales"]}


def _fp8_tensors(k: int, n: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    return {"weight": w, "weight_scale": torch.rand(n, generator=gen) * 0.01 + 0.001}


def _fp8_block_tensors(k: int, n: int, block: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // block), -(-k // block), generator=gen) * 0.01 + 0.001
    return {"weight": w, "weight_scale_inv": scale}


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


# --------------------------------------------------------------------------------- rank checks
def _column(rank: int, qc: Any, tensors: dict[str, Any], bias: bool) -> float:
    from llmhal.layers.linear import ColumnParallelLinear, ReplicatedLinear
    from llmhal.testing.quant_layers import quant_context

    p = "model.layers.0.mlp.down_proj"
    with quant_context(qc):
        rep = _load(ReplicatedLinear(K, N, bias=bias, prefix=p), tensors)
        par = _load(ColumnParallelLinear(K, N, bias=bias, gather_output=True, prefix=p), tensors)
    x = _x(K)
    return _max_err(par(x), rep(x))


def _merged_gather(rank: int, gate_up: dict[str, Any]) -> float:
    """A merged column-parallel layer's gathered output is in the projections' order."""
    from llmhal.layers.linear import MergedColumnParallelLinear, MergedLinear
    from llmhal.testing.quant_layers import quant_context

    p = "model.layers.0.mlp.gate_up_proj"
    with quant_context(None):
        rep = _load(MergedLinear(H, [K, K], prefix=p), gate_up)
        par = _load(MergedColumnParallelLinear(H, [K, K], gather_output=True, prefix=p), gate_up)
    x = _x(H)
    return _max_err(par(x), rep(x))


def _row(rank: int, qc: Any, tensors: dict[str, Any], bias: bool, k: int = K) -> float:
    from llmhal.layers.linear import ReplicatedLinear, RowParallelLinear
    from llmhal.testing.quant_layers import quant_context

    p = "model.layers.0.mlp.down_proj"
    with quant_context(qc):
        rep = _load(ReplicatedLinear(k, N, bias=bias, prefix=p), tensors)
        par = _load(RowParallelLinear(k, N, bias=bias, prefix=p), tensors)
    x = _x(k)
    half = k // 2
    return _max_err(par(x[:, rank * half : (rank + 1) * half]), rep(x))


def _mlp(rank: int, qc: Any, gate_up: dict[str, Any], down: dict[str, Any]) -> float:
    """gate/up column-parallel then down row-parallel: one all-reduce gives the full output."""
    from llmhal.layers.linear import (
        MergedColumnParallelLinear,
        MergedLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from llmhal.testing.quant_layers import quant_context

    pg, pd = "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"
    with quant_context(qc):
        rep_gu = _load(MergedLinear(H, [K, K], prefix=pg), gate_up)
        par_gu = _load(MergedColumnParallelLinear(H, [K, K], prefix=pg), gate_up)
        rep_d = _load(ReplicatedLinear(K, H, bias=True, prefix=pd), down)
        par_d = _load(RowParallelLinear(K, H, bias=True, prefix=pd), down)

    def act(y: torch.Tensor) -> torch.Tensor:
        g, u = y.chunk(2, dim=-1)
        return F.silu(g) * u

    x = _x(H)
    return _max_err(par_d(act(par_gu(x))), rep_d(act(rep_gu(x))))


def _qkv(rank: int, qc: Any, heads: int, kv_heads: int, tensors: dict[str, Any]) -> float:
    """The rank's q/k/v output is its heads' slice of the full one: whole KV groups per rank (6
    heads over 3 KV heads: 4 + 2 query heads), or a KV head replicated on both ranks."""
    from llmhal.layers.linear import QKVLinear, QKVParallelLinear, head_partition
    from llmhal.testing.quant_layers import quant_context

    head = 16
    p = "model.layers.0.self_attn.qkv_proj"
    with quant_context(qc):
        rep = _load(QKVLinear(H, head, heads, kv_heads, bias=True, prefix=p), tensors)
        par = _load(QKVParallelLinear(H, head, heads, kv_heads, bias=True, prefix=p), tensors)
    x = _x(H)
    q, k, v = rep(x).split([heads * head, kv_heads * head, kv_heads * head], dim=-1)
    q0, nq, kv0, nkv = head_partition(heads, kv_heads, 2, rank)
    assert (par.num_heads, par.num_kv_heads) == (nq, nkv)
    kv = slice(kv0 * head, (kv0 + nkv) * head)
    want = torch.cat([q[:, q0 * head : (q0 + nq) * head], k[:, kv], v[:, kv]], dim=-1)
    return _max_err(par(x), want)


def _o_proj(rank: int, qc: Any, heads: int, kv_heads: int, tensors: dict[str, Any]) -> float:
    """The output projection takes the inputs of the rank's query heads (uneven: 4 + 2)."""
    from llmhal.layers.linear import ReplicatedLinear, RowParallelLinear, head_partition
    from llmhal.testing.quant_layers import quant_context

    head, p = 32, "model.layers.0.self_attn.o_proj"
    q0, nq, _, _ = head_partition(heads, kv_heads, 2, rank)
    with quant_context(qc):
        rep = _load(ReplicatedLinear(heads * head, H, prefix=p), tensors)
        par = _load(
            RowParallelLinear(heads * head, H, input_partition=(q0, nq, heads), prefix=p), tensors
        )
    x = _x(heads * head)
    return _max_err(par(x[:, q0 * head : (q0 + nq) * head]), rep(x))


def gguf_moe_output() -> torch.Tensor:
    """A GGUF MoE layer (Q4_0 gate/up, Q8_0 down: 32-weight blocks) on fixed inputs: split over
    the ranks when called in a rank (each keeps half of every expert's 64 intermediate columns,
    whole blocks), whole in a single process."""
    from llmhal.layers.fused_moe import FusedMoE
    from llmhal.quantization.gguf import GGUFConfig
    from llmhal.testing.gguf_files import quantized_rows
    from llmhal.testing.quant_layers import finish, quant_context

    p, experts, inter = "model.layers.0.mlp.experts", 4, 64
    types = {"gate_proj": "Q4_0", "up_proj": "Q4_0", "down_proj": "Q8_0"}
    cfg = GGUFConfig({f"{p}.{part}": t for part, t in types.items()})
    with quant_context(cfg):
        layer = FusedMoE(experts, 2, H, inter, prefix=p)
    for e in range(experts):
        for i, (part, shard) in enumerate((("gate_proj", "w1"), ("up_proj", "w3"))):
            raw = quantized_rows(types[part], inter, H, seed=10 * e + i)
            layer.w13_weight.weight_loader(layer.w13_weight, raw, (e, shard))
        raw = quantized_rows("Q8_0", H, inter, seed=10 * e + 5)
        layer.w2_weight.weight_loader(layer.w2_weight, raw, (e, "w2"))
    finish(layer)
    x = _x(H, tokens=6)
    logits = torch.randn(6, experts, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return layer(x, logits)


def _unsplittable_config() -> Any:
    """A quantization config whose method does not declare ``tp_shardable`` (as bitsandbytes'
    flattened 4-bit blocks do not)."""
    from llmhal.quantization.base import QuantizationConfig
    from llmhal.quantization.unquantized import UnquantizedLinearMethod

    class Opaque(UnquantizedLinearMethod):
        tp_shardable = False

    class OpaqueConfig(QuantizationConfig):
        @classmethod
        def get_name(cls) -> str:
            return "opaque"

        @classmethod
        def get_supported_act_dtypes(cls) -> list[torch.dtype]:
            return [torch.float32]

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> Any:
            return cls()

        def get_quant_method(self, layer: Any, prefix: str) -> Any:
            return Opaque()

    return OpaqueConfig()


def _qkv_layer(heads: int, kv_heads: int) -> Any:
    from llmhal.layers.linear import QKVParallelLinear
    from llmhal.testing.quant_layers import quant_context

    with quant_context(None):
        return QKVParallelLinear(H, 16, heads, kv_heads, prefix="model.layers.0.self_attn.qkv_proj")


def _vocab(rank: int, qc: Any, weight: torch.Tensor, ref: torch.Tensor, prefix: str) -> float:
    """Lookups of ids on both ranks' rows and the full logits, against the reference table."""
    from llmhal.layers.vocab_embedding import VocabParallelEmbedding
    from llmhal.testing.quant_layers import quant_context

    vocab, hidden = ref.shape
    with quant_context(qc):
        emb = _load(VocabParallelEmbedding(vocab, hidden, prefix=prefix), {"weight": weight})
    ids = torch.tensor([0, 1, vocab // 2 - 1, vocab // 2, vocab // 2 + 1, vocab - 1, 7])
    x = _x(hidden)
    err_lookup = _max_err(emb(ids), ref[ids])
    logits = emb.logits(x)
    assert logits.shape == (5, vocab)
    return max(err_lookup, _max_err(logits, x.double() @ ref.double().T) / 10)


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as e:  # the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "no error"


def _all_checks(rank: int) -> dict[str, Any]:
    from llmhal.quantization.awq import AWQConfig
    from llmhal.quantization.fp8 import Fp8Config
    from llmhal.quantization.gguf import GGUFConfig
    from llmhal.quantization.gptq import GPTQConfig
    from llmhal.testing.gguf_files import quantized_rows
    from llmhal.testing.quant_layers import native_quant_kernel

    gen = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen) * 0.1  # noqa: E731
    dense_col = {"weight": rnd(N, K), "bias": rnd(N)}
    gate_up = {"weight": {0: rnd(K, H), 1: rnd(K, H)}}
    down = {"weight": rnd(H, K), "bias": rnd(H)}
    qkv2 = {"weight": {"q": rnd(64, H), "k": rnd(32, H), "v": rnd(32, H)}}
    qkv2["bias"] = {"q": rnd(64), "k": rnd(32), "v": rnd(32)}
    qkv1 = {"weight": {"q": rnd(64, H), "k": rnd(16, H), "v": rnd(16, H)}}
    qkv1["bias"] = {"q": rnd(64), "k": rnd(16), "v": rnd(16)}
    qkv3 = {"weight": {"q": rnd(96, H), "k": rnd(48, H), "v": rnd(48, H)}}
    qkv3["bias"] = {"q": rnd(96), "k": rnd(48), "v": rnd(48)}
    table = rnd(V, H)

    gptq = GPTQConfig.from_config({"bits": 4, "group_size": 32, "desc_act": False})
    gptq_big = GPTQConfig.from_config({"bits": 4, "group_size": 128, "desc_act": False})
    gptq_act = GPTQConfig.from_config({"bits": 4, "group_size": 32, "desc_act": True})
    awq = AWQConfig.from_config({"w_bit": 4, "q_group_size": 32, "zero_point": True})
    fp8 = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic"})
    fp8_block = Fp8Config.from_config(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    )
    gptq_one_group = GPTQConfig.from_config({"bits": 4, "group_size": -1, "desc_act": False})
    down_name = "model.layers.0.mlp.down_proj"
    gguf = GGUFConfig({down_name: "Q8_0", "model.embed_tokens": "Q8_0"})
    gguf_k = GGUFConfig({down_name: "Q4_K"})
    gguf_o_cfg = GGUFConfig({"model.layers.0.self_attn.o_proj": "Q8_0"})
    gguf_rows = quantized_rows("Q8_0", N, K, seed=3)
    gguf_big = quantized_rows("Q8_0", N, 512, seed=4)
    gguf_table = quantized_rows("Q8_0", 256, H, seed=5)
    gguf_ref = torch.from_numpy(
        __import__("gguf").quants.dequantize(
            gguf_table.numpy(), __import__("gguf").GGMLQuantizationType["Q8_0"]
        )
    )
    out: dict[str, Any] = {}
    with native_quant_kernel():
        out["column"] = _column(rank, None, dense_col, bias=True)
        out["row"] = _row(rank, None, {"weight": rnd(N, K), "bias": rnd(N)}, bias=True)
        out["mlp"] = _mlp(rank, None, gate_up, down)
        out["merged_gather"] = _merged_gather(rank, gate_up)
        out["qkv_split_kv"] = _qkv(rank, None, 4, 2, qkv2)
        out["qkv_replicated_kv"] = _qkv(rank, None, 4, 1, qkv1)
        out["qkv_uneven"] = _qkv(rank, None, 6, 3, qkv3)
        out["o_proj_uneven"] = _o_proj(rank, None, 6, 3, {"weight": rnd(H, 6 * 32)})
        gguf_o = {"weight": quantized_rows("Q8_0", H, 6 * 32, seed=6)}
        out["gguf_o_proj_uneven"] = _o_proj(rank, gguf_o_cfg, 6, 3, gguf_o)
        out["vocab"] = _vocab(rank, None, table, table, "model.embed_tokens")
        out["gptq_column"] = _column(rank, gptq, _gptq_tensors(K, N, 32, 1), bias=False)
        out["gptq_row"] = _row(rank, gptq, _gptq_tensors(K, N, 32, 2), bias=True)
        act = _gptq_tensors(K, N, 32, 13, act_order=True)
        out["gptq_act_order_column"] = _column(rank, gptq_act, act, bias=False)
        out["gptq_row_whole_group"] = _row(
            rank, gptq_big, _gptq_tensors(256, N, 128, 3), False, 256
        )
        out["awq_column"] = _column(rank, awq, _awq_tensors(K, N, 32, 4), bias=False)
        out["awq_row"] = _row(rank, awq, _awq_tensors(K, N, 32, 5), bias=False)
        out["fp8_column"] = _column(rank, fp8, _fp8_tensors(K, N, 6), bias=False)
        out["fp8_row"] = _row(rank, fp8, _fp8_tensors(K, N, 7), bias=False)
        out["fp8_block_column"] = _column(rank, fp8_block, _fp8_block_tensors(K, N, 32, 10), False)
        out["fp8_block_row"] = _row(rank, fp8_block, _fp8_block_tensors(K, N, 32, 11), False)
        out["gptq_row_one_group"] = _row(rank, gptq_one_group, _gptq_tensors(K, N, K, 12), False)
        out["gguf_column"] = _column(rank, gguf, {"weight": gguf_rows}, bias=False)
        out["gguf_row"] = _row(rank, gguf, {"weight": gguf_big}, bias=False, k=512)
        out["gguf_vocab"] = _vocab(rank, gguf, gguf_table, gguf_ref, "model.embed_tokens")
        out["err_gptq_group_cut"] = _error(
            lambda: _row(rank, gptq_big, _gptq_tensors(K, N, 128, 8), bias=False)
        )
        out["err_gptq_act_order_row"] = _error(
            lambda: _row(rank, gptq_act, _gptq_tensors(K, N, 32, 9, act_order=True), False)
        )
        out["err_gguf_block_cut"] = _error(
            lambda: _row(
                rank, gguf_k, {"weight": quantized_rows("Q4_K", N, 256, seed=1)}, False, 256
            )
        )
        out["gguf_moe"] = gguf_moe_output()
        out["err_heads"] = _error(lambda: _qkv_layer(heads=3, kv_heads=1))
        opaque = {"weight": rnd(N, K)}
        out["err_unsplittable"] = _error(lambda: _row(rank, _unsplittable_config(), opaque, False))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_all_checks, 2, 1)


EXACT = ["column", "qkv_split_kv", "qkv_replicated_kv", "qkv_uneven", "vocab", "gptq_column"]
EXACT += ["awq_column", "fp8_block_column", "merged_gather", "gptq_act_order_column"]
EXACT += ["fp8_column", "gguf_column", "gguf_vocab"]
SUMMED = [
    "row",
    "o_proj_uneven",
    "gguf_o_proj_uneven",
    "mlp",
    "gptq_row",
    "gptq_row_whole_group",
    "awq_row",
    "fp8_row",
    "gguf_row",
]


SUMMED += ["fp8_block_row", "gptq_row_one_group"]


@pytest.mark.parametrize("check", EXACT + SUMMED)
def test_parallel_layer_equals_single_process(results, check):
    # Column-parallel outputs are the same products; row-parallel ones sum two partial products
    # (float32 rounding of a different summation order).
    tol = 1e-6 if check in EXACT else 1e-4
    for rank, r in enumerate(results):
        assert isinstance(r[check], float), f"rank {rank}: {r[check]}"
        assert r[check] < tol, f"rank {rank}: {check} differs by {r[check]}"


def test_gguf_experts_split_equal_one_process(results):
    """Each rank keeps whole ggml blocks of every expert; the all-reduced output is the whole
    layer's (computed here, in this single process)."""
    from llmhal.testing.quant_layers import native_quant_kernel

    with native_quant_kernel():
        whole = gguf_moe_output()
    for r in results:
        assert _max_err(r["gguf_moe"], whole) < 1e-4


@pytest.mark.parametrize(
    ("check", "words"),
    [
        ("err_gptq_group_cut", "group size"),
        ("err_gptq_act_order_row", "act-order"),
        ("err_gguf_block_cut", "whole quantization groups and blocks"),
        ("err_heads", "tensor_parallel_size"),
        ("err_unsplittable", "does not split across tensor-parallel ranks"),
    ],
)
def test_a_split_that_would_cut_a_group_is_a_clear_error(results, check, words):
    for r in results:
        assert words in r[check], r[check]
