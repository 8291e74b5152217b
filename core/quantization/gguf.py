"""GGUF: llama.cpp's block-quantized weights, kept quantized in memory.

A :class:`GGUFConfig` is built from a GGUF file (:meth:`llmhal.model_loader.gguf_loader.GGUFFile.
quant_config`): the ggml type of every weight, keyed by the HF module name it loads into
(``model.layers.0.self_attn.q_proj``). Layers whose tensors are quantized get a
:class:`GGUFLinearMethod` (a token embedding: :class:`GGUFEmbeddingMethod`); float tensors
(F32/F16/BF16) get the unquantized method.

The method's ``weight`` parameter is a placeholder whose loader keeps each shard's raw rows (uint8
``[rows, row_bytes]``, exactly as the file stores them). Once loaded, consecutive shards of the same
type are joined and turned into one kernel each (a Q4_K_M file mixes Q4_K and Q6_K inside q/k/v;
such a layer runs one kernel per run of equal types and concatenates their outputs):

* ``LLMHAL_GGUF_KERNEL=auto`` (default): Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 go, in their exact grouped form
  (:func:`~llmhal.quantization.gguf_dequant.to_grouped`), to the platform's ``quant_linear`` kernel.
  K-quants do too where the platform kernel supports their grouping (Q4_K/Q5_K have groups of 32);
  the others (Q2_K/Q3_K/Q6_K, groups of 16) stay raw and are dequantized in row chunks per call.
* ``LLMHAL_GGUF_KERNEL=dequant``: every weight stays raw and is dequantized exactly, in row chunks,
  with float32 products (the reference).

A quantized embedding table dequantizes only the rows looked up; as the tied LM head
(``VocabEmbedding.logits``) it runs through the same kernels as a linear layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from llmhal.layers.weights import WeightLoadError
from llmhal.quantization.base import QuantizationConfig, QuantizeMethodBase
from llmhal.quantization.gguf_dequant import GGMLType, GGUFRawWeight, ggml_type, to_grouped
from llmhal.quantization.grouped_linear import (
    DenseKernel,
    GroupedLinearMethod,
    GroupedPart,
    make_kernel,
)
from llmhal.quantization.module_names import checkpoint_modules
from llmhal.quantization.tracked_params import (
    add_stash_param,
    check_loaded,
    layer_name,
    shard_ids,
    shard_slices,
    stashed,
)

KERNEL_MODES = ("auto", "dequant")
# Formats that map exactly onto the grouped form with llama.cpp's own grouping: always dispatched.
_DISPATCHED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
_EMBED, _LM_HEAD = "model.embed_tokens", "lm_head"


def kernel_mode() -> str:
    """``LLMHAL_GGUF_KERNEL`` (read when a layer is built); unknown values list the valid ones."""
    from llmhal import envs

    mode = (envs.get("LLMHAL_GGUF_KERNEL") or "auto").strip().lower()
    if mode not in KERNEL_MODES:
        raise ValueError(
            f"LLMHAL_GGUF_KERNEL={mode!r} is not a GGUF kernel mode; use one of {', '.join(KERNEL_MODES)}"
        )
    return mode


class GGUFConfig(QuantizationConfig):
    """The ggml type of each weight of a GGUF file, keyed by HF module name (no ``.weight``)."""

    def __init__(self, tensor_types: Mapping[str, int | str], tie_word_embeddings: bool = False):
        super().__init__()
        self.tensor_types: dict[str, GGMLType] = {}
        for module, t in tensor_types.items():
            try:
                self.tensor_types[module] = ggml_type(t)
            except ValueError as e:
                raise ValueError(f"GGUF tensor {module}.weight: {e}") from None
        self.tie_word_embeddings = tie_word_embeddings

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for t in self.tensor_types.values():
            counts[t.name] = counts.get(t.name, 0) + 1
        return f"GGUFConfig({', '.join(f'{n}: {c}' for n, c in sorted(counts.items()))})"

    @classmethod
    def get_name(cls) -> str:
        return "gguf"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        """``{"tensor_types": {module: ggml type id or name}, "tie_word_embeddings": bool}``."""
        if "tensor_types" not in config:
            raise ValueError(
                "A GGUF quantization config comes from the .gguf file itself: use "
                "llmhal.model_loader.gguf_loader.GGUFFile(path).quant_config()"
            )
        return cls(config["tensor_types"], bool(config.get("tie_word_embeddings", False)))

    def types_for(self, prefix: str) -> list[GGMLType] | None:
        """Per-shard types of layer ``prefix``; None when the file has no tensor for it."""
        names = checkpoint_modules(prefix, self.packed_modules_mapping)
        if names == [_LM_HEAD] and _LM_HEAD not in self.tensor_types and self.tie_word_embeddings:
            names = [_EMBED]  # a tied file has no output.weight: the head is the embedding
        found = [self.tensor_types.get(n) for n in names]
        if all(t is None for t in found):
            return None
        lacking = [n for n, t in zip(names, found, strict=True) if t is None]
        if lacking:
            raise ValueError(
                f"Layer {prefix} merges {names}, but the GGUF file has no tensor for "
                f"{', '.join(f'{n}.weight' for n in lacking)}"
            )
        return found  # type: ignore[return-value]

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from llmhal.layers.fused_moe import FusedMoE
        from llmhal.layers.vocab_embedding import ParallelLMHead, VocabEmbedding

        if isinstance(layer, FusedMoE):  # experts: llmhal.quantization.gguf_moe
            from llmhal.quantization.gguf_moe import GGUFMoEMethod, gguf_expert_types

            experts = gguf_expert_types(self.tensor_types, prefix)
            if experts is None or all(t.is_float for t in experts.values()):
                return None
            return GGUFMoEMethod(experts, kernel_mode())
        types = self.types_for(prefix)
        if types is None or all(t.is_float for t in types):
            return None
        if isinstance(layer, VocabEmbedding):
            return GGUFEmbeddingMethod(
                types, kernel_mode(), lookups=not isinstance(layer, ParallelLMHead)
            )
        return GGUFLinearMethod(types, kernel_mode())


class GGUFLinearMethod(GroupedLinearMethod):
    """Raw GGUF rows per shard at load; kernels per run of equal types after (module docstring)."""

    method_name = "gguf"
    # Its checkpoint tensors split across tensor-parallel ranks (llmhal.layers.linear).
    tp_shardable = True

    def __init__(self, types: list[GGMLType], mode: str) -> None:
        self.types = types
        self.mode = mode

    @property
    def checkpoint_params(self) -> list[str]:
        return ["weight"]

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        if len(self.types) != len(output_sizes):
            raise ValueError(
                f"{layer_name(layer)}: {len(output_sizes)} shards but {len(self.types)} GGUF types"
            )
        for t in self.types:
            try:
                t.row_bytes(input_size)
            except ValueError as e:
                raise ValueError(f"{layer_name(layer)}: {e}") from None
        param = add_stash_param(layer, "weight")
        # Rows are outputs and a row's bytes are whole ggml blocks along the inputs: tensor
        # parallelism (llmhal.layers.linear) cuts rows anywhere, a row only between blocks.
        param.output_dim, param.input_dim = 0, 1
        param.shard_unit = 1 if self.types[0].is_float else self.types[0].type_size
        keep = param.weight_loader

        def load(p: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
            self._check(layer, loaded, shard_id)
            keep(p, loaded, shard_id)

        param.weight_loader = load

    def _expected(self, layer: nn.Module, shard_id: Any) -> tuple[GGMLType, tuple[int, int]]:
        ids = shard_ids(layer)
        if shard_id is None:
            if len(set(self.types)) != 1:
                raise WeightLoadError(
                    f"{layer_name(layer)} mixes GGUF types {[t.name for t in self.types]}: load it "
                    f"per shard ({ids})"
                )
            rows = sum(layer.output_sizes)
            t = self.types[0]
        elif shard_id in ids:
            t = self.types[ids.index(shard_id)]
            rows = shard_slices(layer)[shard_id][1]
        else:
            raise WeightLoadError(f"{layer_name(layer)}: unknown shard {shard_id!r}; shards {ids}")
        k = layer.input_size
        return t, (rows, k if t.is_float else t.row_bytes(k))

    def _check(self, layer: nn.Module, loaded: torch.Tensor, shard_id: Any) -> None:
        t, shape = self._expected(layer, shard_id)
        where = "" if shard_id is None else f" shard {shard_id!r}"
        if t.is_float != loaded.is_floating_point():
            form = "a float tensor" if t.is_float else "raw uint8 rows"
            raise WeightLoadError(
                f"{layer_name(layer)}{where} is {t.name} in the GGUF file and expects {form}, got "
                f"{loaded.dtype}"
            )
        if not t.is_float and loaded.dtype != torch.uint8:
            raise WeightLoadError(
                f"{layer_name(layer)}{where}: raw {t.name} rows must be uint8, got {loaded.dtype}"
            )
        if tuple(loaded.shape) != shape:
            unit = (
                ""
                if t.is_float
                else f" ({t.name} rows of {shape[1]} bytes for K={layer.input_size})"
            )
            raise WeightLoadError(
                f"{layer_name(layer)}{where}: checkpoint shape {tuple(loaded.shape)} does not match "
                f"expected {shape}{unit}"
            )

    def _runs(self, layer: nn.Module) -> list[tuple[GGMLType, torch.Tensor]]:
        """(type, rows) per run of consecutive shards of one type, in output order."""
        check_loaded(layer, self.checkpoint_params, self.method_name)
        stash = stashed(layer, "weight")
        if None in stash:  # the whole (uniform) layer in one tensor
            return [(self.types[0], stash[None])]
        shards = list(zip(self.types, (stash[s] for s in shard_ids(layer)), strict=True))
        runs = []
        for t, group in itertools.groupby(shards, key=lambda p: p[0]):
            rows = [r for _, r in group]
            runs.append((t, torch.cat(rows) if len(rows) > 1 else rows[0]))
        return runs

    def _kernel(self, layer: nn.Module, t: GGMLType, rows: torch.Tensor) -> Any:
        k = layer.input_size
        if t.is_float:
            return DenseKernel(rows.to(layer.params_dtype))
        if self.mode == "dequant":
            return GGUFRawWeight(rows, t, k, layer.params_dtype)
        weight = to_grouped(rows, t)
        if t.name in _DISPATCHED:
            return make_kernel(weight, layer.params_dtype)
        from llmhal.ops.quant_linear import NativeQuantLinear
        from llmhal.ops.registry import get_op

        cls = get_op("quant_linear")
        supports = getattr(cls, "supports", None)
        if cls is not NativeQuantLinear and supports is not None:
            if supports(weight, layer.params_dtype) is None:
                return cls(weight, layer.params_dtype)
        return GGUFRawWeight(rows, t, k, layer.params_dtype)

    def grouped_parts(self, layer: nn.Module) -> list[GroupedPart]:
        """The exact grouped form of each run (for inspection; loading builds kernels directly)."""
        return [
            GroupedPart(rows.to(torch.float32) if t.is_float else to_grouped(rows, t))
            for t, rows in self._runs(layer)
        ]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from llmhal.quantization.tracked_params import release

        runs = self._runs(layer)
        layer.quant_kernels = [(self._kernel(layer, t, rows), None) for t, rows in runs]
        self._keep_rows(layer, runs)
        release(layer, self.checkpoint_params)

    def _keep_rows(self, layer: nn.Module, runs: list[tuple[GGMLType, torch.Tensor]]) -> None:
        """Hook for the embedding method (which keeps row-addressable storage)."""

    def describe(self, layer: nn.Module) -> str:
        types = "+".join(dict.fromkeys(t.name for t in self.types))
        kernels = getattr(layer, "quant_kernels", None)
        if not kernels:
            return f"gguf {types} (not loaded)"
        names = "+".join(dict.fromkeys(getattr(k, "name", type(k).__name__) for k, _ in kernels))
        return f"gguf {types} -> {names}"


class GGUFEmbeddingMethod(GGUFLinearMethod):
    """A GGUF embedding table: row lookups dequantize only those rows; ``apply`` is the LM head."""

    def __init__(self, types: list[GGMLType], mode: str, lookups: bool = True) -> None:
        super().__init__(types, mode)
        self.lookups = lookups

    def _keep_rows(self, layer: nn.Module, runs: list[tuple[GGMLType, torch.Tensor]]) -> None:
        if not self.lookups:
            return
        ((t, rows),) = runs  # an embedding table has one shard
        kernel = layer.quant_kernels[0][0]
        # A kernel with row lookups (native, raw rows) serves both; an opaque packed layout
        # (e.g. int4pack) needs the raw rows kept beside it.
        layer.gguf_rows = (
            kernel
            if hasattr(kernel, "embedding")
            else GGUFRawWeight(rows, t, layer.input_size, layer.params_dtype)
        )

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        rows = getattr(layer, "gguf_rows", None)
        if rows is None:
            raise RuntimeError(
                f"{layer_name(layer)}: embedding lookup before process_weights_after_loading, or on "
                "an LM head built without lookups"
            )
        return rows.embedding(ids)

    def weight_bytes(self, layer: nn.Module) -> int:
        total = super().weight_bytes(layer)
        rows = getattr(layer, "gguf_rows", None)
        if rows is not None and all(rows is not k for k, _ in layer.quant_kernels):
            total += rows.weight_bytes()
        return total
