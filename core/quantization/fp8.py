"""FP8 (e4m3) weights: checkpoints in the "fp8" format, and online quantization of plain checkpoints.

Checkpoint format (``quant_method: "fp8"``, written by llm-compressor / AutoFP8 / vLLM tools)::

    <layer>.weight        float8_e4m3fn [N, K]
    <layer>.weight_scale  float32 [] or [1] (per tensor), or [N] / [N, 1] (per output channel)
    <layer>.input_scale   float32 [] / [1]   (only with ``activation_scheme: "static"``)

with ``w = weight * weight_scale``. With ``weight_block_size: [bn, bk]`` (DeepSeek style) the scale
is ``weight_scale_inv`` [ceil(N/bn), ceil(K/bk)], one per block. A merged layer (q/k/v, gate/up)
receives one scale per shard; they are kept per shard, as a per-output-row scale vector (exact),
and only the fp8-matmul path, which needs a single weight scale for per-tensor scaling, requantizes
the shards to the largest one (as vLLM does; the rounding this adds is below fp8 resolution).

How it runs, decided per layer after loading, from platform data only:

* ``capabilities.fp8_compute`` (and no block scales, dims multiple of 16): ``torch._scaled_mm``
  with the activations quantized to fp8 (per tensor, or per token when the weight scales differ
  per row), static ``input_scale`` when the checkpoint has one.
* otherwise weight-only: the weight stays fp8 in memory (1 byte per value) and is converted in row
  chunks at each call (the per-row scale is applied to the output); ``LLMHAL_FP8_DEQUANT=load``
  converts it once at load instead (faster on CPUs, 2-4x the memory).

Platforms whose fp8 is the "fnuz" variant (``capabilities.extra["fp8_dtype"] ==
"float8_e4m3fnuz"``, e.g. ROCm gfx94x) get the checkpoint's e4m3fn bits reinterpreted as e4m3fnuz
with the scale doubled (the same bits mean half the value there; e4m3fn's -0, which is NaN in fnuz,
becomes +0), which is exact.

Online (``quantization="fp8"`` on an unquantized checkpoint): weights load in the model dtype and
are quantized per output channel (``scale = amax / fp8_max``) once the layer is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmhal.layers.weights import WeightLoadError
from llmhal.quantization.base import QuantizationConfig, QuantizeMethodBase
from llmhal.quantization.module_names import kv_cache_scale_name, quantizes_linear
from llmhal.quantization.tracked_params import (
    FLOAT_DTYPES,
    add_param,
    add_stash_param,
    check_loaded,
    release,
    shard_segments,
    stashed_max,
    tensor_where,
)

FP8_CHECKPOINT_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
# Values converted per chunk in the weight-only path: small enough that the temporaries stay in
# cache and are reused by the allocator (1536x576 at once was 15x slower than in 4 chunks).
CHUNK_ELEMENTS = 1 << 18


def platform_fp8_dtype(platform: Any) -> torch.dtype:
    """The platform's fp8 e4m3 variant, from its capability data (default: OCP e4m3fn)."""
    name = platform.capabilities.extra.get("fp8_dtype", "float8_e4m3fn")
    dtype = getattr(torch, str(name), None)
    if dtype not in FP8_CHECKPOINT_DTYPES:
        raise ValueError(
            f"platform {platform.name!r} reports fp8_dtype={name!r}; expected one of "
            "float8_e4m3fn, float8_e4m3fnuz"
        )
    return dtype


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def fp8_to(w8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact e4m3 (fn or fnuz) -> ``dtype`` conversion through bit arithmetic.

    ``(bits & 0x7F) << 4`` read as bfloat16 is the e4m3fn value times 2^-120, denormals included
    (both formats put the mantissa right below the exponent); multiplying by a power of two
    restores it exactly. On CPUs this is about 5x faster than ``Tensor.to`` (measured, one
    thread: 0.48 ms vs 2.7 ms for 1536x576). fp8 NaNs do not survive (checkpoints have none).
    """
    factor = 2.0**120 if w8.dtype == torch.float8_e4m3fn else 2.0**119  # fnuz: bias 8, not 7
    u = w8.view(torch.uint8).to(torch.int16)
    bits = ((u & 0x7F) << 4) | ((u & 0x80) << 8)
    w = bits.view(torch.bfloat16) * factor
    return w if dtype == torch.bfloat16 else w.to(dtype)


def e4m3fn_to_fnuz(weight: torch.Tensor) -> torch.Tensor:
    """Reinterpret e4m3fn bits as e4m3fnuz (value halves; the caller doubles the scale)."""
    bits = weight.view(torch.int8).clone()
    bits[bits == -128] = 0  # -0 in e4m3fn is NaN in e4m3fnuz
    return bits.view(torch.float8_e4m3fnuz)


def quantize_per_row(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row fp8 quantization: (fp8 weight, float32 scale [N])."""
    wf = w.to(torch.float32)
    scale = wf.abs().amax(dim=1).clamp(min=1e-12) / fp8_max(dtype)
    q = (wf / scale[:, None]).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype)
    return q, scale


@dataclass(frozen=True)
class Fp8Scheme:
    """What an fp8 checkpoint holds for a layer (shared with compressed-tensors' FP8 schemes)."""

    serialized: bool = True  # False: quantize a model-dtype weight online
    static_input_scale: bool = False  # the checkpoint has ``input_scale``
    block: tuple[int, int] | None = None  # (bn, bk) block scales
    scale_name: str = "weight_scale"


class Fp8Config(QuantizationConfig):
    """``quantization_config`` with ``quant_method: "fp8"``, or online fp8 quantization."""

    def __init__(
        self,
        is_checkpoint_fp8_serialized: bool = True,
        activation_scheme: str = "dynamic",
        ignored_layers: list[str] | None = None,
        weight_block_size: list[int] | None = None,
    ) -> None:
        super().__init__()
        if activation_scheme not in ("static", "dynamic"):
            raise ValueError(
                f"fp8 activation_scheme {activation_scheme!r} is not known (static, dynamic)"
            )
        if weight_block_size is not None:
            if not is_checkpoint_fp8_serialized:
                raise ValueError(
                    "fp8 block scales need an fp8 checkpoint (not online quantization)"
                )
            if len(weight_block_size) != 2 or min(weight_block_size) <= 0:
                raise ValueError(f"fp8 weight_block_size must be [bn, bk], got {weight_block_size}")
        self.is_checkpoint_fp8_serialized = is_checkpoint_fp8_serialized
        self.activation_scheme = activation_scheme
        self.ignored_layers = list(ignored_layers or [])
        self.weight_block_size = list(weight_block_size) if weight_block_size else None

    def __repr__(self) -> str:
        return (
            f"Fp8Config(serialized={self.is_checkpoint_fp8_serialized}, "
            f"activation_scheme={self.activation_scheme}, block={self.weight_block_size})"
        )

    @classmethod
    def get_name(cls) -> str:
        return "fp8"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        method = str(cls.get_from_keys_or(config, ["quant_method"], "fp8")).lower()
        return cls(
            is_checkpoint_fp8_serialized="fp8" in method,
            activation_scheme=cls.get_from_keys_or(config, ["activation_scheme"], "dynamic"),
            ignored_layers=cls.get_from_keys_or(
                config, ["ignored_layers", "modules_to_not_convert"], None
            ),
            weight_block_size=cls.get_from_keys_or(config, ["weight_block_size"], None),
        )

    @classmethod
    def is_online(cls) -> bool:
        return True

    @classmethod
    def online_config(cls) -> Fp8Config:
        return cls(is_checkpoint_fp8_serialized=False)

    @classmethod
    def availability(cls, platform: Any) -> list[str]:
        return fp8_availability(platform)

    def get_cache_scale(self, name: str) -> str | None:
        return kv_cache_scale_name(name)

    def scheme(self) -> Fp8Scheme:
        block = tuple(self.weight_block_size) if self.weight_block_size else None
        return Fp8Scheme(
            serialized=self.is_checkpoint_fp8_serialized,
            static_input_scale=self.is_checkpoint_fp8_serialized
            and self.activation_scheme == "static",
            block=block,  # type: ignore[arg-type]
            scale_name="weight_scale_inv" if block else "weight_scale",
        )

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from llmhal.quantization.expert_linears import declines_router, is_moe_layer, moe_method

        if is_moe_layer(layer):
            return moe_method(self, layer, prefix)
        if declines_router(layer) or not quantizes_linear(
            layer, prefix, self.ignored_layers, self.packed_modules_mapping
        ):
            return None
        return Fp8LinearMethod(self.scheme())


def fp8_availability(platform: Any) -> list[str]:
    if not platform.capabilities.fp8_storage:
        # Suggest only methods the platform's allow-list accepts (None: every method).
        allowed = platform.supported_quantization
        options = [
            label
            for name, label in (
                ("gptq", "gptq"),
                ("awq", "awq"),
                ("compressed-tensors", "compressed-tensors W8A16"),
            )
            if allowed is None or name in allowed
        ]
        remedy = (
            f"use an int8/int4 method ({', '.join(options)}) instead"
            if options
            else f"this platform supports no int8/int4 method either (supported here: "
            f"{', '.join(allowed)})"
        )
        return [
            f"the {platform.name} platform cannot store fp8 tensors (capabilities.fp8_storage is "
            f"False); {remedy}"
        ]
    return []


class Fp8LinearMethod(QuantizeMethodBase):
    """fp8 weights with per-tensor, per-channel or block scales (see the module docstring)."""

    # Its checkpoint tensors split across tensor-parallel ranks (llmhal.layers.linear).
    tp_shardable = True

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def _param_names(self) -> list[str]:
        names = ["weight"]
        if self.scheme.serialized:
            names.append(self.scheme.scale_name)
        if self.scheme.static_input_scale:
            names.append("input_scale")
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
        shape = (sum(output_sizes), input_size)
        if not self.scheme.serialized:
            add_param(layer, "weight", shape, params_dtype, loader, output_dim=0, input_dim=1)
            return
        add_param(layer, "weight", shape, torch.float8_e4m3fn, loader,
                  dtypes=FP8_CHECKPOINT_DTYPES, output_dim=0, input_dim=1)  # fmt: skip
        scale = add_stash_param(layer, self.scheme.scale_name, dtypes=FLOAT_DTYPES)
        # Per-channel scales run along the outputs, block scales along both: tensor parallelism
        # cuts them with the weight (a per-tensor scale, one value, is kept whole).
        scale.output_dim, scale.input_dim = 0, 1
        if self.scheme.static_input_scale:
            add_stash_param(layer, "input_scale", dtypes=FLOAT_DTYPES)

    # ------------------------------------------------------------------------------- loading
    def _row_scales(self, layer: nn.Module) -> tuple[torch.Tensor, bool]:
        """Per-output-row float32 scale [N], or per-row block scales [N, K/bk] for block schemes;
        and whether every shard had a single (per-tensor) scale."""
        name, k = self.scheme.scale_name, layer.input_size
        rows, per_tensor = [], True
        for sid, t, size in shard_segments(layer, name):
            where = tensor_where(layer, name, sid)
            t = t.to(torch.float32)
            if self.scheme.block is not None:
                bn, bk = self.scheme.block
                want = (-(-size // bn), -(-k // bk))
                if tuple(t.shape) != want:
                    raise WeightLoadError(
                        f"{where}: block scale shape {tuple(t.shape)}, expected {want} for "
                        f"{size} rows x {k} inputs in {bn}x{bk} blocks"
                    )
                rows.append(t.repeat_interleave(bn, dim=0)[:size])
                per_tensor = False
            elif t.numel() == 1:
                rows.append(t.reshape(1).expand(size))
            elif t.numel() == size and t.dim() <= 2 and t.shape[0] == size:
                rows.append(t.reshape(size))
                per_tensor = False
            else:
                raise WeightLoadError(
                    f"{where}: scale shape {tuple(t.shape)} is neither per tensor ([] or [1]) nor "
                    f"per output channel ([{size}] or [{size}, 1])"
                )
        return torch.cat(rows).contiguous(), per_tensor

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from llmhal.platforms import get_current_platform

        check_loaded(layer, self._param_names(), "fp8")
        platform = get_current_platform()
        target = platform_fp8_dtype(platform)
        if self.scheme.serialized:
            weight = layer.weight.data
            scale, per_tensor = self._row_scales(layer)
            if target == torch.float8_e4m3fnuz:
                weight, scale = e4m3fn_to_fnuz(weight), scale * 2
        else:
            weight, scale = quantize_per_row(layer.weight.data, target)
            per_tensor = False
        input_scale = None
        if self.scheme.static_input_scale:
            # One activation scale per layer: shards' static scales are merged to the largest.
            input_scale = stashed_max(layer, "input_scale")
            if target == torch.float8_e4m3fnuz:
                input_scale *= 2
        release(layer, self._param_names())
        caps = platform.capabilities
        n, k = weight.shape
        use_mm = caps.fp8_compute and self.scheme.block is None and n % 16 == 0 and k % 16 == 0
        if use_mm and per_tensor and bool((scale != scale[0]).any()):
            # Shards with different per-tensor scales: requantize to the largest (see docstring).
            top = scale.max()
            weight = (weight.to(torch.float32) * (scale / top)[:, None]).to(target)
            scale = top.reshape(1).expand(n).contiguous()
        layer.fp8_mode = "scaled_mm" if use_mm else _weight_only_mode()
        layer.fp8_dtype = target
        layer.fp8_input_scale = input_scale
        layer.fp8_per_tensor = bool((scale == scale[0]).all()) if scale.dim() == 1 else False
        if layer.fp8_mode == "load":
            layer.register_buffer(
                "weight_dequant", _dequant(weight, scale, self.scheme.block, layer.params_dtype)
            )
            return
        layer.register_buffer("weight_fp8", weight.contiguous())
        layer.register_buffer("weight_scale_rows", scale)

    # --------------------------------------------------------------------------------- compute
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        mode = layer.fp8_mode
        if mode == "load":
            return F.linear(x, layer.weight_dequant, bias)
        if mode == "scaled_mm":
            return self._scaled_mm(layer, x, bias)
        return self._dequant_per_call(layer, x, bias)

    def _dequant_per_call(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        w8, scale = layer.weight_fp8, layer.weight_scale_rows
        n, k = w8.shape
        rows = max(16, CHUNK_ELEMENTS // k)
        outs = []
        for s in range(0, n, rows):
            e = min(s + rows, n)
            if self.scheme.block is None:
                # Per-row scales commute with the matmul: scale the (small) output instead.
                outs.append(F.linear(x, fp8_to(w8[s:e], x.dtype)) * scale[s:e].to(x.dtype))
            else:
                outs.append(F.linear(x, _dequant(w8[s:e], scale[s:e], self.scheme.block, x.dtype)))
        y = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        return y if bias is None else y + bias

    def activation_scale(self, layer: nn.Module, x2: torch.Tensor, per_token: bool) -> torch.Tensor:
        """The fp8 scale of activations ``x2`` [M, K]: per tensor ([]) or per token ([M, 1]).

        Static checkpoints use their ``input_scale``; otherwise ``amax / fp8_max``. Subclasses
        change the rule (FBGEMM's upper bound on the activation range)."""
        top = fp8_max(layer.fp8_dtype)
        if layer.fp8_input_scale is not None:
            shape = (x2.shape[0], 1) if per_token else ()
            return torch.full(shape, layer.fp8_input_scale, dtype=torch.float32, device=x2.device)
        amax = x2.abs().amax(dim=1, keepdim=True) if per_token else x2.abs().amax()
        return (amax.float() / top).clamp(min=1e-12)

    def _scaled_mm(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        w8, scale, dtype = layer.weight_fp8, layer.weight_scale_rows, layer.fp8_dtype
        top = fp8_max(dtype)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        per_token = not layer.fp8_per_tensor  # per-row weight scales need rowwise scaling
        sx = self.activation_scale(layer, x2, per_token)
        sw = scale.reshape(1, -1) if per_token else scale[:1].reshape(())
        xq = (x2.float() / sx).clamp(-top, top).to(dtype)
        # Rowwise scaling produces bfloat16 only (CUDA's kernels); cast back after.
        out_dtype = torch.bfloat16 if per_token else x.dtype
        out_bias = None if bias is None else bias.to(out_dtype)
        y = torch._scaled_mm(xq, w8.t(), scale_a=sx, scale_b=sw, bias=out_bias, out_dtype=out_dtype)
        return y.to(x.dtype).reshape(*shape[:-1], w8.shape[0])

    def describe(self, layer: nn.Module) -> str:
        block = f" block {self.scheme.block}" if self.scheme.block else ""
        mode = getattr(layer, "fp8_mode", "not loaded")
        return f"fp8{block} ({'online' if not self.scheme.serialized else 'checkpoint'}) -> {mode}"


def _weight_only_mode() -> str:
    from llmhal import envs

    value = (envs.get("LLMHAL_FP8_DEQUANT") or "call").strip().lower()
    if value not in ("call", "load"):
        raise ValueError(f"LLMHAL_FP8_DEQUANT={value!r}: use 'call' (default) or 'load'")
    return value


def _dequant(
    w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """fp8 rows times their per-row scale [n] or per-row block scales [n, K/bk]."""
    wf = fp8_to(w8, torch.float32)
    if block is None:
        return (wf * scale[:, None]).to(dtype)
    k = w8.shape[1]
    return (wf * scale.repeat_interleave(block[1], dim=1)[:, :k]).to(dtype)
