"""The quantization contract.

A :class:`QuantizationConfig` describes one checkpoint's quantization (parsed from the checkpoint's
``quantization_config`` or a GGUF file) and hands each layer a :class:`QuantizeMethodBase`, which

1. ``create_weights``: registers the layer's parameters in their stored (quantized) form, each with
   a ``weight_loader`` and the attributes the loader needs (see :mod:`llmhal.layers.linear`);
2. ``process_weights_after_loading``: repacks them once loaded (e.g. into a kernel's layout);
3. ``apply``: computes the layer's output from an activation.

Methods are looked up by name in :mod:`llmhal.quantization.registry`. The engine checks, before any
weight loads, the platform's allow-list (``Platform.verify_quantization``), :meth:`get_min_capability`,
:meth:`get_supported_act_dtypes` and :meth:`availability`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from llmhal.platforms import Platform


class QuantizeMethodBase(ABC):
    """How one layer stores and applies its (possibly quantized) weights."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        """Register parameters on ``layer``. ``output_sizes`` lists the merged shards (q, k, v...)."""

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``y = x @ W.T + bias`` for linear layers, with ``W`` in whatever form the method keeps."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after all weights of ``layer`` are loaded (repack, transpose, free)."""

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight for token ``ids`` (for quantized embedding tables)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement embedding lookup")

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes of weight storage this method holds for ``layer`` (for memory reports).

        The default counts the layer's own parameters and buffers; a method that keeps tensors
        elsewhere (e.g. in a kernel object after repacking) must override it.
        """
        tensors = [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def describe(self, layer: nn.Module) -> str:
        """Short description for logs and ``doctor`` (e.g. "gguf Q4_1 -> int4pack")."""
        return type(self).__name__


class QuantizationConfig(ABC):
    """A quantization method's parsed configuration; built with :meth:`from_config`."""

    def __init__(self) -> None:
        self.packed_modules_mapping: dict[str, list[str]] = {}

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The registry name ("gguf", "fp8", ...)."""

    @classmethod
    @abstractmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        """Activation dtypes the method's kernels accept."""

    @classmethod
    def get_min_capability(cls) -> int:
        """Minimum device capability as ``major*10+minor``; -1 = any (checked where one exists)."""
        return -1

    @staticmethod
    def get_config_filenames() -> list[str]:
        """Extra files in the model folder that hold the config (besides config.json)."""
        return []

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Parse the checkpoint's ``quantization_config`` dict (or the method's own file)."""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for ``layer`` (named ``prefix``); None leaves the layer unquantized."""

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None
    ) -> str | None:
        """Claim a checkpoint of another method's format (e.g. gptq -> gptq_marlin); None = no."""
        return None

    @classmethod
    def is_online(cls) -> bool:
        """True when the method can quantize an unquantized checkpoint while loading it."""
        return False

    @classmethod
    def online_config(cls) -> QuantizationConfig:
        """The config used for online quantization (``quantization=<name>`` on a plain checkpoint)."""
        raise ValueError(f"{cls.get_name()} cannot quantize an unquantized checkpoint online")

    @classmethod
    def availability(cls, platform: Platform) -> list[str]:
        """Reasons the method cannot run on ``platform`` (missing library, ...); empty = it can."""
        return []

    def map_checkpoint_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """Rename or drop checkpoint tensors before the model routes them (called once by the loader).

        Models route ``<module>.<param>`` names to the module's parameter; a format whose names do
        not have that shape (bitsandbytes stores ``<module>.weight.absmax``) renames them here.
        The default passes the stream through unchanged.
        """
        return weights

    def get_cache_scale(self, name: str) -> str | None:
        """Map a checkpoint's KV-cache scale tensor name to the attention layer's buffer name."""
        return None

    @staticmethod
    def get_from_keys(config: dict[str, Any], keys: list[str]) -> Any:
        for key in keys:
            if key in config:
                return config[key]
        raise ValueError(f"Cannot find any of {keys} in the model's quantization config.")

    @staticmethod
    def get_from_keys_or(config: dict[str, Any], keys: list[str], default: Any) -> Any:
        try:
            return QuantizationConfig.get_from_keys(config, keys)
        except ValueError:
            return default
