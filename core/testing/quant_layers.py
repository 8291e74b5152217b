"""Layer-level checks for quantization methods: build a linear layer under a method, load checkpoint
tensors through its parameters' ``weight_loader``s (as a model's ``load_weights`` does), finish it,
and compare its output with a reference weight.

Used by the tests of each method (and by platforms that want to check their ``quant_linear``
kernel under real checkpoint formats)::

    layer = build_linear(config, "qkv", hidden=256, head=32, heads=4, kv_heads=2)
    load_tensors(layer, {"qweight": {"q": tq, "k": tk, "v": tv}, ...})
    finish(layer)
    assert_close_to_reference(layer, w_ref, atol=...)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from torch import nn


@contextlib.contextmanager
def quant_context(quant_config: Any, dtype: torch.dtype = torch.float32) -> Iterator[Any]:
    """The engine config layers read while they are built (no model, no checkpoint)."""
    from llmhal.config import EngineConfig, ModelConfig, set_current_config

    cfg = EngineConfig(
        model=ModelConfig(
            model="test", hf_config=None, dtype=dtype, architecture="test", max_model_len=64
        ),
        quant_config=quant_config,
    )
    with set_current_config(cfg):
        yield cfg


@contextlib.contextmanager
def native_quant_kernel() -> Iterator[None]:
    """Run ``quant_linear`` with core's exact :class:`NativeQuantLinear` instead of the platform's
    kernel (which may trade precision for speed, e.g. bf16 activations on CPU)."""
    from llmhal.ops import registry

    previous = registry._registered.get("quant_linear")
    registry.register_op_kernel("quant_linear", "llmhal.ops.quant_linear:NativeQuantLinear")
    try:
        yield
    finally:  # put back exactly what was there (other ops' registrations are untouched)
        with registry._lock:
            if previous is None:
                registry._registered.pop("quant_linear", None)
            else:
                registry._registered["quant_linear"] = previous
            registry._resolved.pop("quant_linear", None)


@pytest.fixture(autouse=True)
def exact_quant_kernel(request: pytest.FixtureRequest) -> Iterator[None]:
    """Autouse fixture (import it into a test module): tests run the native kernel, for exact
    comparisons, except tests whose name contains ``platform_kernel``, which use the platform's."""
    if "platform_kernel" in request.node.name:
        yield
        return
    with native_quant_kernel():
        yield


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """``|y - ref| / |ref|`` (Frobenius norms, float64)."""
    y, ref = y.to(torch.float64), ref.to(torch.float64)
    return float((y - ref).norm() / ref.norm())


def build_linear(
    quant_config: Any,
    kind: str,
    *,
    dtype: torch.dtype = torch.float32,
    prefix: str | None = None,
    bias: bool = False,
    **sizes: int,
) -> nn.Module:
    """``kind``: "replicated" (``in_features``, ``out_features``), "qkv" (``hidden``, ``head``,
    ``heads``, ``kv_heads``), "merged" (``in_features``, ``out_features`` per shard, ``shards``) or
    "lm_head" (``vocab``, ``hidden``). Prefixes follow llmhal's model naming."""
    from llmhal.layers.linear import MergedLinear, QKVLinear, ReplicatedLinear
    from llmhal.layers.vocab_embedding import ParallelLMHead

    with quant_context(quant_config, dtype):
        if kind == "replicated":
            p = prefix or "model.layers.0.self_attn.o_proj"
            return ReplicatedLinear(
                sizes["in_features"], sizes["out_features"], bias=bias, prefix=p
            )
        if kind == "qkv":
            p = prefix or "model.layers.0.self_attn.qkv_proj"
            return QKVLinear(
                sizes["hidden"],
                sizes["head"],
                sizes["heads"],
                sizes["kv_heads"],
                bias=bias,
                prefix=p,
            )
        if kind == "merged":
            p = prefix or "model.layers.0.mlp.gate_up_proj"
            out = [sizes["out_features"]] * sizes.get("shards", 2)
            return MergedLinear(sizes["in_features"], out, bias=bias, prefix=p)
        if kind == "lm_head":
            return ParallelLMHead(sizes["vocab"], sizes["hidden"], prefix=prefix or "lm_head")
    raise ValueError(f"unknown layer kind {kind!r}")


def load_tensors(layer: nn.Module, tensors: Mapping[str, Any]) -> None:
    """Load ``{param: tensor}`` or ``{param: {shard_id: tensor}}`` through the weight loaders."""
    params = dict(layer.named_parameters(recurse=False))
    for name, value in tensors.items():
        if name not in params:
            raise KeyError(f"layer has no parameter {name!r}; it has {sorted(params)}")
        param = params[name]
        loader = param.weight_loader
        if isinstance(value, Mapping):
            for shard_id, t in value.items():
                loader(param, t, shard_id)
        else:
            loader(param, value)


def finish(layer: nn.Module) -> nn.Module:
    """``process_weights_after_loading``, as the engine calls it once loading is done."""
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def weight_bytes(layer: nn.Module) -> int:
    """Bytes the layer holds for its weight, as the engine counts them."""
    return int(layer.quant_method.weight_bytes(layer))


def layer_output(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from llmhal.layers.vocab_embedding import VocabEmbedding

    with torch.no_grad():
        return layer.logits(x) if isinstance(layer, VocabEmbedding) else layer(x)


def assert_close_to_reference(
    layer: nn.Module,
    w_ref: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    atol: float,
    rtol: float = 0.0,
    tokens: int = 5,
    seed: int = 0,
) -> torch.Tensor:
    """Run ``layer`` on random activations and compare with ``x @ w_ref.T (+ bias)`` in float64."""
    gen = torch.Generator().manual_seed(seed)
    dtype = layer.params_dtype
    x = torch.randn(tokens, w_ref.shape[1], generator=gen).to(dtype)
    y = layer_output(layer, x)
    ref = x.to(torch.float64) @ w_ref.to(torch.float64).T
    if bias is not None:
        ref = ref + bias.to(torch.float64)
    torch.testing.assert_close(y.to(torch.float64), ref, atol=atol, rtol=rtol)
    return y
