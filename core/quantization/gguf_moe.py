"""GGUF experts: a mixture-of-experts layer whose expert weights stay in the file's quantized blocks.

llama.cpp stores each MoE layer's experts as three 3-D tensors (``ffn_gate_exps`` [E, I, H],
``ffn_up_exps`` [E, I, H], ``ffn_down_exps`` [E, H, I]); the GGUF loader yields them per expert as
``experts.<e>.gate_proj/up_proj/down_proj.weight`` raw rows, which :class:`GGUFMoEMethod` stacks as
uint8 ``w13_weight`` [E, 2I, row_bytes(H)] (gate rows then up rows; both must share one type, as
llama.cpp's quantizer writes them) and ``w2_weight`` [E, H, row_bytes(I)].

After loading, each expert's two projections become the same kernels a GGUF linear layer gets
(:meth:`~llmhal.quantization.gguf.GGUFLinearMethod` rules: the platform's ``quant_linear`` on the
exact grouped form where it applies, else exact dequantization in row chunks; ``LLMHAL_GGUF_KERNEL``
applies). The forward is the ``fused_moe`` op with the experts as
:class:`~llmhal.ops.expert_kernels.ExpertKernels` (the platform's op when it accepts that form, else
core's grouped algorithm): tokens sorted by expert, only the chosen experts' kernels run, so an
expert no token chose is never read, and none is expanded to floats in memory.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from llmhal.layers.fused_moe import FusedMoEMethodBase, ShardId, expert_param, expert_rows
from llmhal.layers.weights import WeightLoadError, copy_checked
from llmhal.ops.expert_kernels import ExpertKernels
from llmhal.quantization.gguf_dequant import GGMLType

# The HF module names a GGUF file's expert types are recorded under (see GGUFFile.quant_config):
# ``<experts prefix>.<part>``.
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


class GGUFMoEMethod(FusedMoEMethodBase):
    """Raw GGUF expert rows at load; per-expert GGUF kernels after (module docstring)."""

    def __init__(self, types: dict[str, GGMLType], mode: str) -> None:
        if types["gate_proj"] != types["up_proj"]:
            raise ValueError(
                f"GGUF experts with gate type {types['gate_proj'].name} and up type "
                f"{types['up_proj'].name} are not supported: llmhal stacks them in one tensor"
            )
        self.t13, self.t2, self.mode = types["gate_proj"], types["down_proj"], mode

    # Under tensor parallelism each rank keeps its rows of gate/up and its whole ggml blocks of
    # the down projection's inputs (FusedMoE cuts them by ``w2_input_unit``).
    tp_shardable = True

    @property
    def w2_input_unit(self) -> tuple[int, int]:
        """(weights, stored entries) of one indivisible unit along the down projection's inputs."""
        return (1, 1) if self.t2.is_float else (self.t2.block_size, self.t2.type_size)

    @staticmethod
    def _shape(t: GGMLType, e: int, rows: int, k: int) -> tuple[int, int, int]:
        return (e, rows, k if t.is_float else t.row_bytes(k))

    def create_weights(  # type: ignore[override]
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        self.params_dtype = params_dtype

        def loader(t: GGMLType) -> Any:
            def load(param: torch.Tensor, loaded: torch.Tensor, shard: ShardId) -> None:
                if shard[0] is None:
                    raise WeightLoadError("GGUF experts load one expert at a time")
                if t.is_float != loaded.is_floating_point():
                    raise WeightLoadError(
                        f"expert {shard[0]} {shard[1]} is {t.name} in the GGUF file, got "
                        f"{loaded.dtype}"
                    )
                dst = expert_rows(param.data, shard, intermediate_size)
                copy_checked(dst, loaded, f"expert {shard[0]} {shard[1]} ({t.name} rows)")

            return load

        for name, t, rows, k in (
            ("w13", self.t13, 2 * intermediate_size, hidden_size),
            ("w2", self.t2, hidden_size, intermediate_size),
        ):
            dtype = params_dtype if t.is_float else torch.uint8
            shape = self._shape(t, num_experts, rows, k)
            layer.register_parameter(f"{name}_weight", expert_param(shape, dtype, loader(t)))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from llmhal.quantization.gguf import GGUFLinearMethod

        def stack(t: GGMLType, w: torch.Tensor, k: int) -> ExpertKernels:
            # The linear method's kernel choice reads only these two attributes of its layer.
            shape = SimpleNamespace(input_size=k, params_dtype=self.params_dtype)
            method = GGUFLinearMethod([t], self.mode)
            return ExpertKernels([method._kernel(shape, t, w[e]) for e in range(w.shape[0])])

        layer.gguf_experts = (
            stack(self.t13, layer.w13_weight.data, layer.hidden_size),
            stack(self.t2, layer.w2_weight.data, layer.intermediate_size),
        )
        # The kernels hold the rows (or their grouped form) from here on.
        del layer.w13_weight, layer.w2_weight

    def apply(  # type: ignore[override]
        self, layer: nn.Module, x: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        k13, k2 = layer.gguf_experts
        return layer.run_op(x, k13, k2, router_logits)

    def weight_bytes(self, layer: nn.Module) -> int:
        kept = sum(s.weight_bytes() for s in getattr(layer, "gguf_experts", ()))
        return super().weight_bytes(layer) + kept

    def describe(self, layer: nn.Module) -> str:
        kernels = getattr(layer, "gguf_experts", None)
        names = "" if kernels is None else f" -> {getattr(kernels[0][0], 'name', 'kernel')}"
        return f"gguf experts {self.t13.name}/{self.t2.name}{names}"


def gguf_expert_types(tensor_types: dict[str, GGMLType], prefix: str) -> dict[str, GGMLType] | None:
    """The GGUF types of the experts of MoE layer ``prefix``; None when the file has none."""
    found = {p: tensor_types.get(f"{prefix}.{p}") for p in EXPERT_PARTS}
    if all(t is None for t in found.values()):
        return None
    missing = [p for p, t in found.items() if t is None]
    if missing:
        raise ValueError(f"the GGUF file has no {', '.join(missing)} experts for {prefix}")
    return found  # type: ignore[return-value]
