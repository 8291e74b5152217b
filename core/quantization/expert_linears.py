"""Quantized checkpoints' experts (GPTQ, AWQ, compressed-tensors, FP8): each expert kept in its
checkpoint's quantized form, as linear layers of the checkpoint's own method.

A GPTQ/AWQ/compressed-tensors/FP8 checkpoint of a MoE model stores every expert's projections as
that method stores a linear layer (``experts.<e>.gate_proj.qweight``, ``qzeros``, ``scales``,
``g_idx``; ``weight_packed``, ``weight_scale``; FP8 ``weight`` with ``weight_scale_inv`` blocks, as
DeepSeek-V3 ships). vLLM runs the integer ones with its ``moe_wna16`` method and FP8 with its FP8
MoE method; here each expert becomes two linear layers of the checkpoint's own method (gate and up
merged, then down), so the format code is the linear method's, unchanged:

* each projection's tensors load into its layer as they would into a dense model's;
* after loading, the linear method builds its kernel: the platform's ``quant_linear`` for the integer
  formats (4 or 8 bits per weight kept; no expert is dequantized to floats, except the rare GPTQ
  ``g_idx`` with unequal groups, which the linear method itself stores dense), FP8's own path
  (``torch._scaled_mm`` or fp8 kept and converted per call) for FP8; an online FP8 run
  (``quantization="fp8"`` on a plain checkpoint) quantizes each expert as it loads;
* the forward is ``fused_moe`` with the experts as
  :class:`~llmhal.ops.expert_kernels.ExpertKernels`: tokens sorted by expert, only the chosen
  experts' kernels run.

Which experts the checkpoint quantizes is the method's own rule (GPTQModel ``dynamic`` and
``modules_in_block_to_quantize``, AWQ ``modules_to_not_convert``, compressed-tensors ``targets`` and
``ignore``), asked of each expert projection by name. Checkpoints spell the experts two ways
(Mixtral and MiniMax: ``block_sparse_moe.experts.<e>.w1/w3/w2``; Qwen-MoE, DeepSeek, OLMoE:
``mlp.experts.<e>.gate_proj/up_proj/down_proj``); the rules are asked in the spelling they use
themselves (:func:`checkpoint_spelling`). The router (:class:`~llmhal.layers.fused_moe.RouterLinear`)
stays unquantized for these methods, as in vLLM.

Memory: two small modules per expert while the model is built (their checkpoint-form tensors are
released once the kernels exist). Tensor parallelism keeps whole experts on every rank (correct,
not split).
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
from torch import nn

from llmhal.layers.fused_moe import FusedMoE, FusedMoEMethodBase, RouterLinear, ShardId
from llmhal.layers.weights import WeightLoadError
from llmhal.ops.expert_kernels import ExpertKernels
from llmhal.quantization.base import QuantizationConfig, QuantizeMethodBase
from llmhal.quantization.unquantized import UnquantizedLinearMethod

# Our merged gate/up layer of one expert, and the shard each checkpoint projection fills.
GATE_UP, DOWN = "gate_up_proj", "down_proj"
_SHARD = {"w1": 0, "w3": 1, "w2": None}
# Mixtral's spelling of one expert's merged gate/up layer, expanded through the packed mapping.
_MIXTRAL_GATE_UP = "w13"
_MIXTRAL_PACKED = {_MIXTRAL_GATE_UP: ["w1", "w3"]}


def _rules_text(config: QuantizationConfig) -> str:
    """The checkpoint config's rules as text (what it names), without the model's merge mapping."""
    fields = {k: v for k, v in vars(config).items() if k != "packed_modules_mapping"}
    return json.dumps(fields, default=repr)


def checkpoint_spelling(config: QuantizationConfig) -> tuple[str, str] | None:
    """How the checkpoint's rules spell the experts: None for llmhal's own names
    (``mlp.experts.<e>.gate_proj``...), else (block, gate/up name) for Mixtral's
    (``w1/w3/w2``, under ``block_sparse_moe`` when the rules say so). Rules name one spelling; asking
    both would let an exclusion written for one be overruled by the other's default."""
    text = _rules_text(config)
    block = "block_sparse_moe" if "block_sparse_moe" in text else None
    if block is None and not re.search(r"(?<![A-Za-z0-9_])w[123](?![A-Za-z0-9_])", text):
        return None
    return block or "mlp", _MIXTRAL_GATE_UP


def _checkpoint_name(prefix: str, spelling: tuple[str, str] | None) -> str:
    """Our expert layer ``...mlp.experts.<e>.gate_up_proj``/``down_proj`` as the rules name it."""
    if spelling is None:
        return prefix
    block, gate_up = spelling
    parent, _, last = prefix.rpartition(".")
    parent = parent.replace(".mlp.experts.", f".{block}.experts.")
    return f"{parent}.{gate_up if last == GATE_UP else 'w2'}"


class _CheckpointNames(QuantizationConfig):
    """The checkpoint's config, asked about an expert layer by the name its rules use."""

    def __init__(self, inner: QuantizationConfig) -> None:
        super().__init__()
        self.inner = inner
        self.spelling = checkpoint_spelling(inner)
        for merged, parts in _MIXTRAL_PACKED.items():
            inner.packed_modules_mapping.setdefault(merged, parts)

    @classmethod
    def get_name(cls) -> str:
        return "checkpoint_names"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        raise NotImplementedError("built by ExpertLinearsMoEMethod only")

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        return self.inner.get_quant_method(layer, _checkpoint_name(prefix, self.spelling))


def expert_layers(
    names: _CheckpointNames, prefix: str, hidden: int, intermediate: int, dtype: torch.dtype
) -> nn.Module:
    """One expert as linear layers of the checkpoint's method (``names``, built once per MoE layer:
    its spelling is the config's, not the expert's): ``gate_up_proj`` (shards 0 and 1) and
    ``down_proj``, named ``<prefix>.gate_up_proj`` / ``.down_proj``."""
    from llmhal.layers.linear import MergedLinear, ReplicatedLinear

    expert = nn.Module()
    kw = {"quant_config": names, "params_dtype": dtype}
    expert.gate_up_proj = MergedLinear(
        hidden, [intermediate, intermediate], prefix=f"{prefix}.{GATE_UP}", **kw
    )
    expert.down_proj = ReplicatedLinear(intermediate, hidden, prefix=f"{prefix}.{DOWN}", **kw)
    return expert


def _quantized(expert: nn.Module) -> bool:
    return any(
        not isinstance(m.quant_method, UnquantizedLinearMethod)
        for m in (expert.gate_up_proj, expert.down_proj)
    )


def moe_method(
    config: QuantizationConfig, layer: nn.Module, prefix: str
) -> FusedMoEMethodBase | None:
    """The MoE side of a weight-only integer method, for its ``get_quant_method``: None (the experts
    stay unquantized and stacked) when the checkpoint's rules quantize no projection of expert 0,
    else :class:`ExpertLinearsMoEMethod`."""
    from llmhal.layers.linear import quant_and_dtype

    _, dtype = quant_and_dtype(config, None)
    names = _CheckpointNames(config)
    probe = expert_layers(names, f"{prefix}.0", layer.hidden_size, layer.intermediate_size, dtype)
    return ExpertLinearsMoEMethod(names, first=probe) if _quantized(probe) else None


def is_moe_layer(layer: nn.Module) -> bool:
    return isinstance(layer, FusedMoE)


def declines_router(layer: nn.Module) -> bool:
    """True for a MoE router, which these methods leave unquantized (see the module docstring)."""
    return isinstance(layer, RouterLinear)


class ExpertLinearsMoEMethod(FusedMoEMethodBase):
    """Experts as per-expert linear layers of the checkpoint's method (module docstring)."""

    def __init__(self, names: _CheckpointNames, first: nn.Module | None = None) -> None:
        self.names = names
        self._first = first  # expert 0, built when the method was chosen

    def create_weights(  # type: ignore[override]
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        experts = []
        for e in range(num_experts):
            if e == 0 and self._first is not None:
                experts.append(self._first)
                continue
            experts.append(
                expert_layers(self.names, f"{layer.prefix}.{e}", hidden_size,
                              intermediate_size, params_dtype)
            )  # fmt: skip
        self._first = None
        # Children, so the engine runs each linear method's process_weights_after_loading and
        # counts what its kernels keep.
        layer.expert_linears = nn.ModuleList(experts)
        layer.expert_kernels = (
            ExpertKernels([x.gate_up_proj for x in experts]),
            ExpertKernels([x.down_proj for x in experts]),
        )

    def load_expert_tensor(
        self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: ShardId
    ) -> str:
        expert, part = shard
        if expert is None:
            raise WeightLoadError(
                f"{layer.prefix}: quantized experts load one expert at a time; the checkpoint "
                f"gives {name!r} for all experts at once"
            )
        if not 0 <= expert < len(layer.expert_linears):
            raise WeightLoadError(
                f"expert {expert} is out of range: the layer has {len(layer.expert_linears)}"
            )
        tensor_name = name.partition("_")[2]
        target = getattr(layer.expert_linears[expert], DOWN if part == "w2" else GATE_UP)
        param = target._parameters.get(tensor_name)
        if param is None:
            raise WeightLoadError(
                f"{target.prefix} runs as {target.quant_method.describe(target)}, which has no "
                f"tensor {tensor_name!r} (has: {', '.join(target._parameters)})"
            )
        shard_id = _SHARD[part]
        if shard_id is None:
            param.weight_loader(param, tensor)  # type: ignore[attr-defined]
        else:
            param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
        return f"expert_linears.{expert}.{DOWN if part == 'w2' else GATE_UP}.{tensor_name}"

    def apply(  # type: ignore[override]
        self, layer: nn.Module, x: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        k13, k2 = layer.expert_kernels
        return layer.run_op(x, k13, k2, router_logits)

    def describe(self, layer: nn.Module) -> str:
        first = layer.expert_linears[0]
        parts = {m.quant_method.describe(m) for m in (first.gate_up_proj, first.down_proj)}
        return f"{self.names.inner.get_name()} experts ({' / '.join(sorted(parts))})"
