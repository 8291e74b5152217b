"""GPTQ: 4- and 8-bit group-quantized weights in the packed int32 format of AutoGPTQ / GPTQModel.

Checkpoint tensors per linear layer (K inputs, N outputs, group size g, ``per = 32 // bits``):

``qweight`` int32 [K/per, N]
    word ``[i, n]`` holds inputs ``k = per*i + j`` of output ``n`` in bits ``[j*bits, (j+1)*bits)``;
``qzeros`` int32 [K/g, N/per]
    word ``[gi, j]`` holds the zero points of outputs ``per*j ... per*j + per-1`` of group ``gi``,
    packed the same way;
``scales`` float16 [K/g, N];
``g_idx`` int32 [K]
    the group of each input column (``k // g`` unless the checkpoint was made with act-order,
    ``desc_act=True``, where columns are quantized in order of decreasing Hessian diagonal).

Dequantization: ``w[n, k] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])``. The stored zero
point depends on the checkpoint version: format ``gptq`` (v1, AutoGPTQ's convention) stores
``z - 1`` (so the value read is ``stored + 1``; a symmetric 4-bit checkpoint stores 7 for z=8);
``gptq_v2`` (GPTQModel) stores ``z`` itself.

Mapping onto the grouped form (:mod:`llmhal.ops.quant_linear`): ``scale = s``, ``offset = -z*s``,
exact. With act-order, the input columns are sorted by group (a stable sort of ``g_idx``): every
group then occupies ``g`` consecutive columns of the permuted weight, and activations are permuted
the same way at run time (see :mod:`llmhal.quantization.grouped_linear`). A ``g_idx`` whose groups
are not all of size g (not produced by GPTQ, but well formed) is dequantized to a dense weight.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from llmhal.quantization.base import QuantizationConfig, QuantizeMethodBase
from llmhal.quantization.grouped_linear import (
    GroupedLinearMethod,
    GroupedPart,
    act_order_parts,
    add_zeros_and_scales,
    stashed_g_idx,
)
from llmhal.quantization.int_packing import unpack_int32
from llmhal.quantization.module_names import agree, name_matches
from llmhal.quantization.tracked_params import (
    add_param,
    add_stash_param,
    check_loaded,
    layer_name,
)

SUPPORTED_BITS = (4, 8)
FORMATS = ("gptq", "gptq_v2")


class GPTQConfig(QuantizationConfig):
    """``quantization_config`` with ``quant_method: "gptq"`` (AutoGPTQ, GPTQModel, optimum)."""

    # The layer method; platform variants (other kernels) substitute a subclass.
    linear_method_cls: type[GPTQLinearMethod]

    def __init__(
        self,
        bits: int,
        group_size: int,
        desc_act: bool,
        sym: bool = True,
        lm_head: bool = False,
        checkpoint_format: str = "gptq",
        dynamic: dict[str, dict[str, Any]] | None = None,
        modules_in_block_to_quantize: list[str] | None = None,
    ) -> None:
        super().__init__()
        if bits not in SUPPORTED_BITS:
            raise ValueError(
                f"GPTQ with bits={bits} is not supported; llmhal runs {SUPPORTED_BITS}-bit GPTQ "
                "checkpoints."
            )
        if checkpoint_format not in FORMATS:
            raise ValueError(
                f"GPTQ checkpoint_format {checkpoint_format!r} is not supported; known: {FORMATS}"
            )
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"GPTQ group_size must be positive or -1, got {group_size}")
        self.bits = bits
        self.group_size = group_size
        self.desc_act = desc_act
        self.sym = sym
        self.lm_head = lm_head
        self.checkpoint_format = checkpoint_format
        self.dynamic = dynamic or {}
        self.modules_in_block_to_quantize = modules_in_block_to_quantize

    def __repr__(self) -> str:
        return (
            f"GPTQConfig(bits={self.bits}, group_size={self.group_size}, desc_act={self.desc_act}, "
            f"sym={self.sym}, format={self.checkpoint_format})"
        )

    @classmethod
    def get_name(cls) -> str:
        return "gptq"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # The grouped kernels are pure torch on any device; GPU-specific kernels (Marlin) are
        # separate methods that claim GPTQ checkpoints on capable devices.
        return -1

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
        blocks = config.get("modules_in_block_to_quantize")
        flat = [m for group in blocks for m in group] if blocks else None
        return cls(
            bits=int(cls.get_from_keys(config, ["bits", "w_bit"])),
            group_size=int(cls.get_from_keys(config, ["group_size", "q_group_size"])),
            desc_act=bool(cls.get_from_keys_or(config, ["desc_act"], False)),
            sym=bool(cls.get_from_keys_or(config, ["sym"], True)),
            lm_head=bool(cls.get_from_keys_or(config, ["lm_head"], False)),
            checkpoint_format=str(fmt).lower(),
            dynamic=cls.get_from_keys_or(config, ["dynamic"], None),
            modules_in_block_to_quantize=flat,
        )

    def _module_settings(self, name: str) -> dict[str, Any] | None:
        """This checkpoint module's settings, or None when it is left unquantized."""
        settings = {"bits": self.bits, "group_size": self.group_size, "sym": self.sym}
        settings["desc_act"] = self.desc_act
        # GPTQModel's "dynamic": regex -> overrides; a "-:" key excludes the matching modules.
        for pattern, overrides in self.dynamic.items():
            if pattern.startswith("-:"):
                if re.match(pattern[2:], name):
                    return None
            elif re.match(pattern.removeprefix("+:"), name):
                settings.update({k: v for k, v in overrides.items() if k in settings})
        if (
            self.modules_in_block_to_quantize is not None
            and ".layers." in f".{name}"
            and not any(name_matches(name, m) for m in self.modules_in_block_to_quantize)
        ):
            return None
        return settings

    def _settings_key(self, name: str) -> tuple[tuple[str, Any], ...] | None:
        settings = self._module_settings(name)
        return None if settings is None else tuple(sorted(settings.items()))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from llmhal.layers.linear import LinearBase
        from llmhal.layers.vocab_embedding import ParallelLMHead
        from llmhal.quantization.expert_linears import declines_router, is_moe_layer, moe_method

        if is_moe_layer(layer):
            return moe_method(self, layer, prefix)
        if declines_router(layer):
            return None
        if isinstance(layer, ParallelLMHead) and self.lm_head:
            settings = self._module_settings(prefix)
        elif isinstance(layer, LinearBase):
            key = agree(prefix, self.packed_modules_mapping, self._settings_key)
            settings = None if key is None else dict(key)
        else:
            return None
        if settings is None:
            return None
        if settings["bits"] not in SUPPORTED_BITS:
            raise ValueError(f"{prefix}: GPTQ bits={settings['bits']} is not supported")
        return self.linear_method_cls(self, settings["bits"], settings["group_size"])


class GPTQLinearMethod(GroupedLinearMethod):
    method_name = "gptq"
    # Its checkpoint tensors split across tensor-parallel ranks (llmhal.layers.linear).
    tp_shardable = True
    checkpoint_params = ["qweight", "qzeros", "scales", "g_idx"]  # type: ignore[assignment]

    def __init__(self, config: GPTQConfig, bits: int, group_size: int) -> None:
        self.config = config
        self.bits = bits
        self.pack = 32 // bits
        self.group_size_cfg = group_size

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
        g = k if self.group_size_cfg == -1 else self.group_size_cfg
        name = layer_name(layer)
        if k % g or k % self.pack:
            raise ValueError(
                f"{name}: GPTQ needs the input size ({k}) to be a multiple of the group size ({g}) "
                f"and of {self.pack}"
            )
        bad = [s for s in output_sizes if s % self.pack]
        if bad:
            raise ValueError(
                f"{name}: GPTQ packs {self.pack} zero points per int32 along the outputs; output "
                f"sizes {output_sizes} are not all multiples of {self.pack}"
            )
        layer.gptq_group_size = g
        # A row-parallel rank (llmhal.layers.linear) holds inputs from ``input_start`` on; one
        # group over all inputs (group_size -1) is every rank's group 0.
        start = getattr(layer, "input_start", 0)
        layer.g_idx_base = 0 if self.group_size_cfg == -1 else start // g
        int32 = [torch.int32]
        add_param(layer, "qweight", (k // self.pack, n), torch.int32, loader, dtypes=int32,
                  input_dim=0, output_dim=1, packed_dim=0, packed_factor=self.pack)  # fmt: skip
        add_zeros_and_scales(layer, loader, k, n, g, self.pack)
        # One group index per input column: a row-parallel layer keeps its columns' entries.
        add_stash_param(layer, "g_idx", dtypes=[torch.int32, torch.int64]).input_dim = 0

    def grouped_parts(self, layer: nn.Module) -> list[GroupedPart]:
        check_loaded(layer, ["qweight", "qzeros", "scales", "g_idx"], "GPTQ")
        g = layer.gptq_group_size
        q = unpack_int32(layer.qweight.data, self.bits, dim=0).t()  # [N, K] unsigned
        z = unpack_int32(layer.qzeros.data, self.bits, dim=1).t().to(torch.float32)  # [N, K/g]
        if self.config.checkpoint_format == "gptq":
            z = z + 1
        scale = layer.scales.data.t().contiguous()
        offset = -z * scale
        if self.bits == 8:
            # Signed storage for the 8-bit grouped form: s*(u - z) = s*(u - 128) + s*(128 - z).
            q = (q.to(torch.int16) - 128).to(torch.int8)
            offset = offset + 128 * scale
            offset = None if bool((offset == 0).all()) else offset

        g_idx = stashed_g_idx(layer, "g_idx", g)
        return act_order_parts(layer, q, scale, offset, g, self.bits, g_idx)


GPTQConfig.linear_method_cls = GPTQLinearMethod
