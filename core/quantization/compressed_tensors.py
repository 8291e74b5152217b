"""compressed-tensors: checkpoints written by llm-compressor / the compressed-tensors library.

``quantization_config`` (``quant_method: "compressed-tensors"``) holds ``config_groups``, each with
``targets`` (module names, ``re:`` regexes, or class names such as ``Linear``) and a scheme
(``weights`` and ``input_activations`` arguments, and, in newer versions, its own ``format``), an
``ignore`` list, and a top-level ``format``. A layer takes the scheme of the best-matching group
(exact name before regex before class name, as the library orders them); merged layers (q/k/v,
gate/up) need one scheme for all their projections. The schemes and their tensors are described in
:mod:`llmhal.quantization.compressed_tensors_schemes`.

Not supported (refused with the reason): sparsity (``sparsity_config``), transforms
(``transform_config``, e.g. SpinQuant/QuIP rotations), and checkpoints not in ``compressed`` state.
The library itself is not needed to load a checkpoint.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from llmhal.logger import init_logger
from llmhal.quantization.base import QuantizationConfig, QuantizeMethodBase
from llmhal.quantization.compressed_tensors_schemes import CTScheme, QuantArgs, make_method
from llmhal.quantization.fp8 import fp8_availability
from llmhal.quantization.module_names import agree, kv_cache_scale_name

logger = init_logger(__name__)

# Precedence of a target's kind when several groups match one module (lower wins).
_EXACT, _REGEX, _CLASS = 0, 1, 2


class CompressedTensorsConfig(QuantizationConfig):
    def __init__(
        self,
        groups: dict[str, tuple[list[str], CTScheme]],
        ignore: list[str],
        kv_cache_scheme: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.groups = groups
        self.ignore = ignore
        self.kv_cache_scheme = kv_cache_scheme

    def __repr__(self) -> str:
        schemes = {n: s.describe() for n, (_t, s) in self.groups.items()}
        return f"CompressedTensorsConfig({schemes}, ignore={self.ignore})"

    @classmethod
    def get_name(cls) -> str:
        return "compressed-tensors"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        for key, what in (("sparsity_config", "sparsity"), ("transform_config", "transforms")):
            if config.get(key):
                raise ValueError(
                    f"compressed-tensors checkpoints with {what} ({key}) are not supported by "
                    "llmhal; use a checkpoint quantized without them."
                )
        status = str(config.get("quantization_status", "compressed")).lower()
        if status != "compressed":
            raise ValueError(
                f"compressed-tensors checkpoint in state {status!r}: only 'compressed' checkpoints "
                "(saved with save_compressed=True, the default) can be loaded."
            )
        top_format = config.get("format") or "dense"
        groups = {}
        for name, raw in (config.get("config_groups") or {}).items():
            weights = QuantArgs.parse(raw.get("weights"))
            if weights is None:
                raise ValueError(f"compressed-tensors group {name!r} has no weights arguments")
            fmt = raw.get("format") or top_format
            if fmt == "mixed-precision":
                raise ValueError(
                    f"compressed-tensors group {name!r} has no format of its own, but the "
                    "checkpoint's format is mixed-precision"
                )
            scheme = CTScheme(weights, QuantArgs.parse(raw.get("input_activations")), str(fmt))
            groups[name] = (list(raw.get("targets") or []), scheme)
        kv = config.get("kv_cache_scheme")
        return cls(groups, list(config.get("ignore") or []), kv)

    @classmethod
    def availability(cls, platform: Any) -> list[str]:
        return []  # per scheme: fp8 schemes check the platform when a layer asks for them

    def scheme_for(self, name: str, class_name: str) -> CTScheme | None:
        """The scheme of checkpoint module ``name`` (None: ignored or not targeted)."""
        if any(_match(name, class_name, t) is not None for t in self.ignore):
            return None
        best: tuple[int, CTScheme] | None = None
        for targets, scheme in self.groups.values():
            for target in targets:
                kind = _match(name, class_name, target)
                if kind is not None and (best is None or kind < best[0]):
                    best = (kind, scheme)
        return None if best is None else best[1]

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from llmhal.layers.linear import LinearBase
        from llmhal.layers.vocab_embedding import ParallelLMHead, VocabEmbedding
        from llmhal.quantization.expert_linears import declines_router, is_moe_layer, moe_method

        if is_moe_layer(layer):
            return moe_method(self, layer, prefix)
        if declines_router(layer):
            return None
        if isinstance(layer, LinearBase) or isinstance(layer, ParallelLMHead):
            class_name = "Linear"
        elif isinstance(layer, VocabEmbedding):
            class_name = "Embedding"
        else:
            return None
        scheme = agree(
            prefix, self.packed_modules_mapping, lambda n: self.scheme_for(n, class_name)
        )
        if scheme is None:
            return None
        if class_name == "Embedding":
            raise ValueError(
                f"{prefix}: quantized embedding tables are not supported for compressed-tensors "
                "checkpoints (add the embedding to the recipe's ignore list)."
            )
        if scheme.weights.type == "float":
            from llmhal.platforms import get_current_platform

            reasons = fp8_availability(get_current_platform())
            if reasons:
                raise ValueError(f"{prefix}: {scheme.describe()}: {reasons[0]}")
        return make_method(scheme, prefix)

    def get_cache_scale(self, name: str) -> str | None:
        return kv_cache_scale_name(name) if self.kv_cache_scheme else None


def _match(name: str, class_name: str, target: str) -> int | None:
    """How ``target`` matches module ``name`` of type ``class_name`` (None: it does not)."""
    if target.startswith("re:"):
        return _REGEX if re.match(target[3:], name) else None
    if target == name:
        return _EXACT
    if target == class_name:
        return _CLASS
    return None
