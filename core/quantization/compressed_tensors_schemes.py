"""compressed-tensors schemes: parsed quantization arguments, and the layer methods for each scheme.

Checkpoint tensors per format (names as the compressed-tensors library writes them):

``pack-quantized`` (int weights, weight-only): ``weight_packed`` int32 [N, K*bits/32] (values
    ``q + 2^(bits-1)`` in ``bits``-bit slots along K), ``weight_scale`` [N, K/g] (group) or [N, 1]
    (channel), ``weight_shape`` int64 [2], and for asymmetric schemes ``weight_zero_point`` int32
    [N*bits/32, K/g] (packed along the outputs). ``actorder: "group"`` adds ``weight_g_idx`` [K].
``naive-quantized`` / ``int-quantized``: ``weight`` int8 [N, K] (``q`` itself), ``weight_scale``,
    ``weight_zero_point`` int8 for asymmetric schemes; W8A8 may add a static ``input_scale``.
``float-quantized`` (FP8): ``weight`` float8_e4m3fn [N, K], ``weight_scale`` [1] / [N, 1] /
    [N/bn, K/bk], static schemes add ``input_scale`` [1].

Dequantization (the library's definition): ``w = (q - zero_point) * scale`` per group, with ``q``
signed. Onto the grouped form: for 4 bits ``q_u = q + 8`` (the packed value), ``scale = s``,
``offset = -(8 + zp) * s``; for 8 bits the signed ``q`` with ``offset = -zp * s`` (None when
symmetric).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmhal.layers.weights import WeightLoadError
from llmhal.quantization.base import QuantizeMethodBase
from llmhal.quantization.grouped_linear import (
    GroupedLinearMethod,
    GroupedPart,
    act_order_parts,
    stashed_g_idx,
)
from llmhal.quantization.int_packing import unpack_int32
from llmhal.quantization.tracked_params import (
    FLOAT_DTYPES,
    add_param,
    add_stash_param,
    check_loaded,
    expect_shape,
    layer_name,
    shard_segments,
    shard_slices,
    stashed_max,
    tensor_where,
)

PACKED = "pack-quantized"
NAIVE_FORMATS = ("naive-quantized", "int-quantized", "float-quantized")
SUPPORTED = (
    "int weight-only W4A16/W8A16 (group or channel scales, symmetric or asymmetric, "
    "pack-quantized or naive), W8A8 int8 (channel or tensor weight scales, symmetric dynamic "
    "per-token or static per-tensor activations), FP8 (tensor, channel or block weight scales, "
    "static or dynamic activations)"
)


@dataclass(frozen=True)
class QuantArgs:
    """One ``weights`` / ``input_activations`` entry of a scheme."""

    num_bits: int
    type: str  # "int" or "float"
    symmetric: bool
    strategy: str  # tensor, channel, group, block, token
    group_size: int | None = None
    dynamic: bool = False
    block_structure: tuple[int, int] | None = None
    actorder: str | None = None

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> QuantArgs | None:
        if raw is None:
            return None
        block = raw.get("block_structure")
        strategy = raw.get("strategy") or ("group" if raw.get("group_size") else "tensor")
        actorder = raw.get("actorder")
        return cls(
            num_bits=int(raw.get("num_bits", 8)),
            type=str(raw.get("type", "int")),
            symmetric=bool(raw.get("symmetric", True)),
            strategy=str(strategy),
            group_size=raw.get("group_size"),
            dynamic=bool(raw.get("dynamic", False)),
            block_structure=tuple(block) if block else None,  # type: ignore[arg-type]
            actorder=None if actorder in (None, False) else str(actorder),
        )


@dataclass(frozen=True)
class CTScheme:
    weights: QuantArgs
    input_activations: QuantArgs | None
    format: str

    def describe(self) -> str:
        w = self.weights
        a = self.input_activations
        act = (
            "A16"
            if a is None
            else f"A{a.num_bits}{a.type}({a.strategy},{'dyn' if a.dynamic else 'static'})"
        )
        return f"W{w.num_bits}{w.type}({w.strategy}){act} [{self.format}]"


def make_method(scheme: CTScheme, prefix: str) -> QuantizeMethodBase:
    """The layer method for ``scheme``; unsupported schemes raise naming what is supported."""
    w, a = scheme.weights, scheme.input_activations
    if w.type == "float" and w.num_bits == 8:
        from llmhal.quantization.fp8 import Fp8LinearMethod, Fp8Scheme

        if a is not None and (a.type != "float" or not a.symmetric):
            return _unsupported(scheme, prefix)
        if w.strategy not in ("tensor", "channel", "block"):
            return _unsupported(scheme, prefix)
        fp8 = Fp8Scheme(
            serialized=True,
            static_input_scale=a is not None and not a.dynamic,
            block=w.block_structure if w.strategy == "block" else None,
        )
        return Fp8LinearMethod(fp8)
    if w.type != "int" or w.strategy not in ("group", "channel", "tensor"):
        return _unsupported(scheme, prefix)
    if a is None:
        if w.num_bits in (4, 8) and w.strategy in ("group", "channel"):
            if scheme.format == PACKED or scheme.format in NAIVE_FORMATS:
                return CTWNA16Method(scheme)
        return _unsupported(scheme, prefix)
    if (
        w.num_bits == 8
        and a.type == "int"
        and a.num_bits == 8
        and a.symmetric
        and w.symmetric
        and w.strategy in ("channel", "tensor")
        and ((a.dynamic and a.strategy == "token") or (not a.dynamic and a.strategy == "tensor"))
    ):
        return CTW8A8Int8Method(scheme)
    return _unsupported(scheme, prefix)


def _unsupported(scheme: CTScheme, prefix: str) -> QuantizeMethodBase:
    raise ValueError(
        f"{prefix}: the compressed-tensors scheme {scheme.describe()} is not supported. "
        f"Supported: {SUPPORTED}."
    )


# --------------------------------------------------------------------- int weight-only (WnA16)
class CTWNA16Method(GroupedLinearMethod):
    """4/8-bit integer weights with group or channel scales, onto ``quant_linear``."""

    method_name = "compressed-tensors WNA16"

    def __init__(self, scheme: CTScheme) -> None:
        self.scheme = scheme
        self.args = scheme.weights
        self.packed = scheme.format == PACKED
        self.bits = self.args.num_bits

    @property
    def checkpoint_params(self) -> list[str]:  # type: ignore[override]
        names = ["weight_packed", "weight_shape"] if self.packed else ["weight"]
        names.append("weight_scale")
        if not self.args.symmetric:
            names.append("weight_zero_point")
        if self.args.actorder == "group":
            names.append("weight_g_idx")
        return names

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        loader = extra["weight_loader"]
        k, n = input_size, sum(output_sizes)
        g = k if self.args.strategy == "channel" else int(self.args.group_size or k)
        if k % g:
            raise ValueError(
                f"{layer_name(layer)}: input size {k} is not a multiple of the group size {g}"
            )
        per = 32 // self.bits
        if self.packed and k % per:
            raise ValueError(f"{layer_name(layer)}: input size {k} is not a multiple of {per}")
        layer.ct_group_size = g
        if self.packed:
            add_param(layer, "weight_packed", (n, k // per), torch.int32, loader,
                      dtypes=[torch.int32], output_dim=0, input_dim=1,
                      packed_dim=1, packed_factor=per)  # fmt: skip
            add_stash_param(layer, "weight_shape")
        else:
            add_param(layer, "weight", (n, k), torch.int8, loader, dtypes=[torch.int8],
                      output_dim=0, input_dim=1)  # fmt: skip
        add_param(layer, "weight_scale", (n, k // g), torch.float32, loader, dtypes=FLOAT_DTYPES,
                  output_dim=0, input_dim=1)  # fmt: skip
        if not self.args.symmetric:
            if self.packed:
                if any(s % per for s in output_sizes):
                    raise ValueError(
                        f"{layer_name(layer)}: zero points are packed {per} outputs per int32; "
                        f"output sizes {output_sizes} are not all multiples of {per}"
                    )
                add_param(layer, "weight_zero_point", (n // per, k // g), torch.int32, loader,
                          dtypes=[torch.int32], output_dim=0, packed_dim=0,
                          packed_factor=per)  # fmt: skip
            else:
                add_param(layer, "weight_zero_point", (n, k // g), torch.int8, loader,
                          dtypes=[torch.int8], output_dim=0)  # fmt: skip
        if self.args.actorder == "group":
            add_stash_param(layer, "weight_g_idx", dtypes=[torch.int32, torch.int64])

    def grouped_parts(self, layer: nn.Module) -> list[GroupedPart]:
        check_loaded(layer, self.checkpoint_params, "compressed-tensors")
        g, half = layer.ct_group_size, 1 << (self.bits - 1)
        scale = layer.weight_scale.data
        if self.packed:
            self._check_shapes(layer)
            signed = unpack_int32(layer.weight_packed.data, self.bits, 1).to(torch.int16) - half
        else:
            signed = layer.weight.data.to(torch.int16)
        zp = None
        if not self.args.symmetric:
            raw = layer.weight_zero_point.data
            zp = (
                (unpack_int32(raw, self.bits, 0).to(torch.float32) - half)
                if self.packed
                else raw.to(torch.float32)
            )
        if self.bits == 4:
            q = (signed + half).to(torch.uint8)
            offset = -(half + (zp if zp is not None else 0.0)) * scale
        else:
            q = signed.to(torch.int8)
            offset = None if zp is None else -zp * scale
        g_idx = (
            stashed_g_idx(layer, "weight_g_idx", g)
            if self.args.actorder == "group"
            else {
                sid: torch.arange(layer.input_size, device=q.device) // g
                for sid in shard_slices(layer)
            }
        )
        return act_order_parts(layer, q, scale, offset, g, self.bits, g_idx)

    def _check_shapes(self, layer: nn.Module) -> None:
        for sid, shape, rows in shard_segments(layer, "weight_shape"):
            got = tuple(int(v) for v in shape.reshape(-1).tolist())
            want = (rows, layer.input_size)
            if got != want:
                raise WeightLoadError(
                    f"{tensor_where(layer, 'weight_shape', sid)}: the checkpoint says {got}, the "
                    f"layer expects {want}"
                )


# ----------------------------------------------------------------------------- W8A8 int8
class CTW8A8Int8Method(QuantizeMethodBase):
    """int8 weights (per channel or per tensor) times int8 activations quantized per token
    (dynamic) or with a static per-tensor ``input_scale``; int32 accumulation (``torch._int_mm``).

    A merged layer with per-tensor weight scales keeps one scale per shard as a per-row vector
    (the int32 result is rescaled per output row, so nothing is requantized).
    """

    def __init__(self, scheme: CTScheme) -> None:
        self.scheme = scheme
        self.static = not scheme.input_activations.dynamic  # type: ignore[union-attr]

    def _names(self) -> list[str]:
        return ["weight", "weight_scale"] + (["input_scale"] if self.static else [])

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        loader = extra["weight_loader"]
        add_param(layer, "weight", (sum(output_sizes), input_size), torch.int8, loader,
                  dtypes=[torch.int8], output_dim=0, input_dim=1)  # fmt: skip
        add_stash_param(layer, "weight_scale", dtypes=FLOAT_DTYPES)
        if self.static:
            add_stash_param(layer, "input_scale", dtypes=FLOAT_DTYPES)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from llmhal.quantization.tracked_params import release

        check_loaded(layer, self._names(), "compressed-tensors W8A8")
        rows = []
        for sid, t, size in shard_segments(layer, "weight_scale"):
            t = t.to(torch.float32)
            if t.numel() not in (1, size):
                expect_shape(layer, "weight_scale", sid, t, (size, 1))
            rows.append(t.reshape(-1).expand(size) if t.numel() == 1 else t.reshape(size))
        layer.w8a8_input_scale = stashed_max(layer, "input_scale") if self.static else None
        layer.w8a8_int_mm = True
        weight = layer.weight.data
        release(layer, self._names())
        layer.register_buffer("weight_int8", weight)
        layer.register_buffer("weight_scale_rows", torch.cat(rows).contiguous())

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.float32)
        if layer.w8a8_input_scale is not None:
            sx = torch.full((x2.shape[0], 1), layer.w8a8_input_scale, device=x.device)
        else:
            sx = (x2.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
        xq = torch.round(x2 / sx).clamp(-128, 127).to(torch.int8)
        acc = _int8_matmul(layer, xq)
        y = acc * sx * layer.weight_scale_rows
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.to(x.dtype).reshape(*shape[:-1], -1)

    def describe(self, layer: nn.Module) -> str:
        return f"compressed-tensors {self.scheme.describe()} -> int8 matmul"


def _int8_matmul(layer: nn.Module, xq: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] @ int8 weight.T -> float32 [M, N], accumulated exactly in int32 where the
    device has an int8 matmul (``torch._int_mm``), else in float32 (exact while |sum| < 2^24).

    Some devices' ``_int_mm`` needs more than 16 rows (CUDA): small batches are padded to 17.
    """
    w = layer.weight_int8
    if layer.w8a8_int_mm:
        m = xq.shape[0]
        try:
            if m <= 16 and getattr(layer, "w8a8_pad_rows", False):
                padded = torch.nn.functional.pad(xq, (0, 0, 0, 17 - m))
                return torch._int_mm(padded, w.t())[:m].to(torch.float32)
            return torch._int_mm(xq, w.t()).to(torch.float32)
        except (RuntimeError, NotImplementedError):
            if m <= 16 and not getattr(layer, "w8a8_pad_rows", False):
                layer.w8a8_pad_rows = True  # retry this and later small batches padded
                return _int8_matmul(layer, xq)
            layer.w8a8_int_mm = False  # no int8 matmul here: float math from now on
    return xq.to(torch.float32) @ w.t().to(torch.float32)
