"""bitsandbytes: 4-bit (nf4/fp4) and LLM.int8 checkpoints saved by transformers, and online nf4.

Uses the bitsandbytes library (``pip install bitsandbytes``; its CPU backend ships in the wheel) to
read the serialized quantization state and to quantize and multiply 4-bit weights.

Checkpoint tensors per linear layer, as transformers writes them (``Linear4bit`` /
``Linear8bitLt._save_to_state_dict``):

4-bit: ``weight`` uint8 [N*K/2, 1] (two codes per byte, high nibble first, row-major over [N, K]),
    ``weight.absmax`` (one per block of ``blocksize`` values; uint8 when double-quantized, with
    ``weight.nested_absmax`` / ``weight.nested_quant_map``), ``weight.quant_map`` (the 16-entry
    code book) and ``weight.quant_state.bitsandbytes__nf4`` (a JSON blob: quant type, blocksize,
    shape, dtype, nested parameters). Dotted names are not ``<module>.<param>``, so
    :meth:`BitsAndBytesConfig.map_checkpoint_weights` renames them ``weight_absmax``, ...,
    ``weight_quant_state``.
8-bit: ``weight`` int8 [N, K], ``SCB`` float32 [N] (row absmax), ``weight_format`` (0 = row-major,
    the only layout; checked and dropped while renaming). ``w = weight * SCB / 127``: the grouped
    int8 form with one group per row, run by the platform's ``quant_linear`` kernel. Like
    bitsandbytes' own CPU backend, the product uses the dequantized weight (no int8 activations, so
    ``llm_int8_threshold``'s outlier split has nothing to split).

Merged layers (q/k/v, gate/up) get one 4-bit state per shard; double-quantized absmax is expanded
to float32 at load (so no nested dequantization per call), and shards whose blocks line up
(``rows * K`` a multiple of the blocksize, the usual case) are concatenated into one state.

Online (``quantization="bitsandbytes"`` on a plain checkpoint): nf4, blocksize 64, no double
quantization, quantized with bitsandbytes once each layer is loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from llmhal.layers.weights import WeightLoadError
from llmhal.ops.quant_linear import GroupedQuantWeight
from llmhal.quantization.base import QuantizationConfig, QuantizeMethodBase
from llmhal.quantization.grouped_linear import GroupedLinearMethod, GroupedPart
from llmhal.quantization.module_names import quantizes_linear
from llmhal.quantization.tracked_params import (
    FLOAT_DTYPES,
    add_param,
    add_stash_param,
    check_loaded,
    layer_name,
    release,
    shard_slices,
    stashed,
)
from llmhal.utils.imports import is_available, not_installed, require

# Device types bitsandbytes has backends for (its ``backends`` package).
BNB_DEVICE_TYPES = ("cpu", "cuda", "xpu", "hpu", "mps")
_QS_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def _bnb() -> Any:
    return require("bitsandbytes", purpose="bitsandbytes quantization")


class BitsAndBytesConfig(QuantizationConfig):
    """transformers' ``BitsAndBytesConfig`` as saved in config.json, or online nf4."""

    def __init__(
        self,
        load_in_4bit: bool = True,
        quant_type: str = "nf4",
        double_quant: bool = False,
        skip_modules: list[str] | None = None,
        prequantized: bool = True,
        threshold: float = 6.0,
    ) -> None:
        super().__init__()
        if quant_type not in ("nf4", "fp4"):
            raise ValueError(f"bnb_4bit_quant_type {quant_type!r} is not known (nf4, fp4)")
        self.load_in_4bit = load_in_4bit
        self.quant_type = quant_type
        self.double_quant = double_quant
        self.skip_modules = list(skip_modules or [])
        self.prequantized = prequantized
        self.threshold = threshold

    def __repr__(self) -> str:
        kind = f"4-bit {self.quant_type}" if self.load_in_4bit else "8-bit"
        return f"BitsAndBytesConfig({kind}, prequantized={self.prequantized})"

    @classmethod
    def get_name(cls) -> str:
        return "bitsandbytes"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> BitsAndBytesConfig:
        four = bool(cls.get_from_keys_or(config, ["load_in_4bit", "_load_in_4bit"], False))
        eight = bool(cls.get_from_keys_or(config, ["load_in_8bit", "_load_in_8bit"], False))
        if four == eight:
            raise ValueError(
                "bitsandbytes quantization_config must set exactly one of load_in_4bit and "
                f"load_in_8bit (got load_in_4bit={four}, load_in_8bit={eight})"
            )
        return cls(
            load_in_4bit=four,
            quant_type=str(cls.get_from_keys_or(config, ["bnb_4bit_quant_type"], "fp4")),
            double_quant=bool(cls.get_from_keys_or(config, ["bnb_4bit_use_double_quant"], False)),
            skip_modules=cls.get_from_keys_or(config, ["llm_int8_skip_modules"], None),
            threshold=float(cls.get_from_keys_or(config, ["llm_int8_threshold"], 6.0)),
        )

    @classmethod
    def is_online(cls) -> bool:
        return True

    @classmethod
    def online_config(cls) -> BitsAndBytesConfig:
        return cls(load_in_4bit=True, quant_type="nf4", prequantized=False)

    @classmethod
    def availability(cls, platform: Any) -> list[str]:
        reasons = []
        if not is_available("bitsandbytes"):
            reasons.append(not_installed("bitsandbytes", "bitsandbytes"))
        if platform.device_type not in BNB_DEVICE_TYPES:
            reasons.append(
                f"bitsandbytes has no backend for device type {platform.device_type!r} "
                f"(it supports {', '.join(BNB_DEVICE_TYPES)})"
            )
        return reasons

    def map_checkpoint_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith(".weight_format"):
                _check_row_format(name, tensor)
                continue
            head, sep, tail = name.partition(".weight.")
            if sep and tail in _QS_PARTS:
                yield f"{head}.weight_{tail}", tensor
            elif sep and tail.startswith("quant_state.bitsandbytes__"):
                yield f"{head}.weight_quant_state", tensor
            else:
                yield name, tensor

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not quantizes_linear(layer, prefix, self.skip_modules, self.packed_modules_mapping):
            return None
        if not self.load_in_4bit:
            return BnB8bitMethod()
        return BnB4bitMethod(self)


def _check_row_format(name: str, tensor: torch.Tensor) -> None:
    if int(tensor.reshape(-1)[0]) != 0:
        raise WeightLoadError(
            f"{name}: bitsandbytes 8-bit weight format {int(tensor.reshape(-1)[0])} is not "
            "supported; only row-major (0) weights are (re-save with a current bitsandbytes)."
        )


class BnB4bitMethod(QuantizeMethodBase):
    """nf4/fp4 weights multiplied through ``bitsandbytes.matmul_4bit``."""

    def __init__(self, config: BitsAndBytesConfig) -> None:
        self.config = config

    def _names(self) -> list[str]:
        if not self.config.prequantized:
            return ["weight"]
        names = ["weight", "weight_absmax", "weight_quant_map", "weight_quant_state"]
        if self.config.double_quant:
            names += ["weight_nested_absmax", "weight_nested_quant_map"]
        return names

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        if not self.config.prequantized:
            shape = (sum(output_sizes), input_size)
            add_param(layer, "weight", shape, params_dtype, extra["weight_loader"],
                      output_dim=0, input_dim=1)  # fmt: skip
            return
        # uint8 storage by default; bnb_4bit_quant_storage may store the same bytes as another dtype
        add_stash_param(layer, "weight")
        for name in self._names()[1:]:
            add_stash_param(layer, name)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        bnb = _bnb()
        check_loaded(layer, self._names(), "bitsandbytes")
        if self.config.prequantized:
            parts = [
                self._shard_state(layer, sid, size)
                for sid, (_s, size) in shard_slices(layer).items()
            ]
            parts = _merge(parts, layer.input_size)
        else:
            w = layer.weight.data.to(torch.float32)
            packed, state = bnb.functional.quantize_4bit(
                w, blocksize=64, quant_type=self.config.quant_type, compress_statistics=False
            )
            parts = [(packed, state)]
        release(layer, self._names())
        for _packed, state in parts:
            state.dtype = layer.params_dtype
        layer.bnb_parts = parts

    def _shard_state(self, layer: nn.Module, sid: Any, rows: int) -> tuple[torch.Tensor, Any]:
        bnb = _bnb()
        qs = {n.removeprefix("weight_"): stashed(layer, n)[sid] for n in self._names()[1:]}
        blob = qs.pop("quant_state")
        qs[f"quant_state.bitsandbytes__{self.config.quant_type}"] = blob
        where = f"{layer_name(layer)}" + (f" shard {sid!r}" if len(shard_slices(layer)) > 1 else "")
        try:
            state = bnb.functional.QuantState.from_dict(qs, device=blob.device)
        except (ValueError, KeyError, AssertionError) as e:
            raise WeightLoadError(f"{where}: unreadable bitsandbytes quant_state ({e})") from None
        if state.quant_type != self.config.quant_type:
            raise WeightLoadError(
                f"{where}: the weight is {state.quant_type}, the config says "
                f"{self.config.quant_type}"
            )
        want = (rows, layer.input_size)
        if tuple(state.shape) != want:
            raise WeightLoadError(
                f"{where}: quant_state shape {tuple(state.shape)}, expected {want}"
            )
        packed = stashed(layer, "weight")[sid].contiguous().view(torch.uint8)
        if packed.numel() * 2 != rows * layer.input_size:
            raise WeightLoadError(
                f"{where}.weight: {packed.numel()} bytes hold {packed.numel() * 2} 4-bit values, "
                f"expected {rows * layer.input_size}"
            )
        if state.nested:  # expand the double-quantized absmax once, not at every call
            absmax = bnb.functional.dequantize_blockwise(state.absmax, state.state2)
            state.absmax, state.state2, state.offset, state.nested = (
                (absmax + state.offset).to(torch.float32),
                None,
                None,
                False,
            )
        return packed.reshape(-1, 1), state

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        bnb = _bnb()
        outs = [bnb.matmul_4bit(x, packed, quant_state=state) for packed, state in layer.bnb_parts]
        y = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        return y if bias is None else y + bias

    def weight_bytes(self, layer: nn.Module) -> int:
        total = super().weight_bytes(layer)
        for packed, state in getattr(layer, "bnb_parts", []):
            total += packed.numel() * packed.element_size()
            total += state.absmax.numel() * state.absmax.element_size()
        return total

    def describe(self, layer: nn.Module) -> str:
        src = "checkpoint" if self.config.prequantized else "online"
        return f"bitsandbytes {self.config.quant_type} ({src}) -> matmul_4bit"


def _merge(parts: list[tuple[torch.Tensor, Any]], k: int) -> list[tuple[torch.Tensor, Any]]:
    """One state for all shards when their blocks line up (same code book and blocksize)."""
    if len(parts) == 1:
        return parts
    first = parts[0][1]
    aligned = all(
        s.blocksize == first.blocksize
        and s.quant_type == first.quant_type
        and torch.equal(s.code, first.code)
        and (s.shape[0] * k) % s.blocksize == 0
        for _p, s in parts
    )
    if not aligned:
        return parts
    bnb = _bnb()
    rows = sum(s.shape[0] for _p, s in parts)
    state = bnb.functional.QuantState(
        absmax=torch.cat([s.absmax for _p, s in parts]),
        shape=torch.Size((rows, k)),
        code=first.code,
        blocksize=first.blocksize,
        quant_type=first.quant_type,
        dtype=first.dtype,
    )
    return [(torch.cat([p for p, _s in parts]), state)]


class BnB8bitMethod(GroupedLinearMethod):
    """LLM.int8 row-quantized weights as the grouped int8 form (one group per row)."""

    method_name = "bitsandbytes int8"
    checkpoint_params = ["weight", "SCB"]  # type: ignore[assignment]

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        loader = extra["weight_loader"]
        n = sum(output_sizes)
        add_param(layer, "weight", (n, input_size), torch.int8, loader, dtypes=[torch.int8],
                  output_dim=0, input_dim=1)  # fmt: skip
        add_param(layer, "SCB", (n,), torch.float32, loader, dtypes=FLOAT_DTYPES,
                  output_dim=0)  # fmt: skip

    def grouped_parts(self, layer: nn.Module) -> list[GroupedPart]:
        check_loaded(layer, self.checkpoint_params, "bitsandbytes 8-bit")
        scale = (layer.SCB.data.to(torch.float32) / 127.0).reshape(-1, 1)
        w = GroupedQuantWeight(layer.weight.data, scale, None, layer.input_size, 8)
        return [GroupedPart(w)]
