"""The mixture-of-experts layer: every expert's weights stacked in one tensor, run by ``fused_moe``.

:class:`FusedMoE` holds ``w13_weight`` [E, 2I, H] (each expert's gate rows, then its up rows) and
``w2_weight`` [E, H, I] (its down projection) in the form its quantization method chooses, and
computes ``fused_moe(x, ..., router_logits)`` through the op registry (so a platform's kernel runs
when it brings one). The method comes from the engine's quantization config, as for linear layers:
``quant_config.get_quant_method(layer, prefix)`` returns a :class:`FusedMoEMethodBase` for a MoE
layer, or None for unquantized experts.

Checkpoint layouts (:func:`route_expert_tensor`): the published per-expert tensors
(``experts.<e>.w1/w3/w2.weight`` for Mixtral, ``experts.<e>.gate_proj/up_proj/down_proj.weight`` for
Qwen-MoE and DeepSeek) and the fused tensors transformers 5 saves with
``save_original_format=False`` (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]).
A shard id is ``(expert, part)``: part ``w1`` (gate), ``w3`` (up) or ``w2`` (down) of one expert,
or ``(None, "w13")`` / ``(None, "w2")`` for every expert at once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from llmhal.layers.linear import ReplicatedLinear
from llmhal.layers.weights import WeightLoadError, copy_checked
from llmhal.quantization.base import QuantizationConfig, QuantizeMethodBase

ShardId = tuple[int | None, str]

# A per-expert tensor: ``weight``, or a quantized format's tensors (``qweight``, ``scales``, ...).
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(\w+)$")
_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
_PART = {"w1": "w1", "gate_proj": "w1", "w3": "w3", "up_proj": "w3", "w2": "w2", "down_proj": "w2"}


def route_expert_tensor(name: str) -> tuple[str, ShardId] | None:
    """(our parameter name, shard id) for a checkpoint expert tensor; None for any other tensor.

    Per-expert tensor ``<t>`` of a projection maps to ``w13_<t>`` (gate, up) or ``w2_<t>`` (down):
    ``w13_weight`` for plain weights; a quantized checkpoint's ``experts.<e>.w1.qweight`` to
    ``w13_qweight``, which a method either registers or loads through its
    ``load_expert_tensor`` (:class:`FusedMoEMethodBase`)."""
    m = _PER_EXPERT.match(name)
    if m:
        part = _PART[m.group(3)]
        param = f"{'w2' if part == 'w2' else 'w13'}_{m.group(4)}"
        return f"{m.group(1)}.{param}", (int(m.group(2)), part)
    m = _FUSED.match(name)
    if m:
        whole = "w13" if m.group(2) == "gate_up_proj" else "w2"
        return f"{m.group(1)}.{whole}_weight", (None, whole)
    return None


def expert_rows(param: torch.Tensor, shard: ShardId, intermediate: int) -> torch.Tensor:
    """The view of a stacked [E, rows, cols] tensor that shard ``shard`` fills."""
    expert, part = shard
    if expert is None:
        return param
    if not 0 <= expert < param.shape[0]:
        raise WeightLoadError(f"expert {expert} is out of range: the layer has {param.shape[0]}")
    if part == "w1":
        return param[expert, :intermediate]
    if part == "w3":
        return param[expert, intermediate:]
    return param[expert]


class RouterLinear(ReplicatedLinear):
    """A MoE block's router (``gate``: one logit per expert). Weight-only integer methods (GPTQ,
    AWQ, compressed-tensors) leave it unquantized whatever their rules say, as vLLM does:
    checkpoints keep it in float (its few weights decide every token's experts), and its width
    (the number of experts) is rarely a multiple of their packing.

    A router whose weight is wider than the activations (``params_dtype=torch.float32`` in a bf16
    model, as DeepSeek keeps it) returns logits in its own dtype through the ``router_logits`` op,
    which widens the activations itself."""

    _logits_op: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._parameters.get("weight")
        if weight is None or x.dtype == weight.dtype or self.bias is not None:
            return super().forward(x)
        if self._logits_op is None:
            from llmhal.ops.registry import get_op

            self._logits_op = get_op("router_logits")
        return self._logits_op(x, weight)


class FusedMoEMethodBase(QuantizeMethodBase):
    """How a :class:`FusedMoE` layer stores and runs its experts (a quantization method's MoE side).

    ``create_weights(layer, num_experts, hidden_size, intermediate_size, params_dtype)`` registers
    ``w13_weight`` and ``w2_weight`` (and what else the method keeps) with a ``weight_loader(param,
    tensor, shard_id)`` taking the shard ids of :func:`route_expert_tensor`; ``apply(layer, x,
    router_logits)`` returns the layer's output.

    A method whose experts are not stacked parameters (each expert its own quantized layer) may
    instead define ``load_expert_tensor(layer, name, tensor, shard_id) -> str``: the model's loader
    calls it for each per-expert checkpoint tensor (``name`` the routed name, e.g. ``w13_qweight``)
    that matches no parameter of the layer; it returns the name (under the layer) of the parameter
    it filled.
    """

    def create_weights(  # type: ignore[override]
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        raise NotImplementedError

    def apply(  # type: ignore[override]
        self, layer: nn.Module, x: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError


def expert_shapes(num_experts: int, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """The stacked experts' weight shapes, by name: ``w13`` (gate and up rows) and ``w2``."""
    return {
        "w13": (num_experts, 2 * intermediate, hidden),
        "w2": (num_experts, hidden, intermediate),
    }


def expert_param(shape: tuple[int, ...], dtype: torch.dtype, loader: Callable[..., None]) -> Any:
    """An empty expert weight loaded by ``loader(param, tensor, shard_id)``."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Experts in the model dtype."""

    # Under tensor parallelism each rank holds a slice of every expert's intermediate dimension
    # (FusedMoE cuts the checkpoint tensors before this method's loader sees them).
    tp_shardable = True

    def create_weights(  # type: ignore[override]
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        def load(param: torch.Tensor, loaded: torch.Tensor, shard: ShardId) -> None:
            dst = expert_rows(param.data, shard, intermediate_size)
            copy_checked(dst, loaded, f"expert {shard[0]} {shard[1]}")

        for name, shape in expert_shapes(num_experts, hidden_size, intermediate_size).items():
            layer.register_parameter(f"{name}_weight", expert_param(shape, params_dtype, load))

    def apply(  # type: ignore[override]
        self, layer: nn.Module, x: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        return layer.run_op(x, layer.w13_weight, layer.w2_weight, router_logits)

    def describe(self, layer: nn.Module) -> str:
        return f"unquantized experts {str(layer.w13_weight.dtype).removeprefix('torch.')}"


class FusedMoE(nn.Module):
    """``num_experts`` gated MLPs of width ``intermediate_size``; each token uses ``top_k`` of them.

    Routing options are those of :func:`llmhal.ops.fused_moe.select_experts`.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool = True,
        scoring_func: str = "softmax",
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        e_score_correction_bias: bool = False,
        routed_scaling_factor: float = 1.0,
        activation: str = "silu",
        quant_config: QuantizationConfig | None = None,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        from llmhal.layers.linear import quant_and_dtype
        from llmhal.ops.fused_moe import gated_activation

        quant_config, params_dtype = quant_and_dtype(quant_config, params_dtype)
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        gated_activation(activation)  # an unknown activation fails here, not at the first step
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation = activation
        self.prefix = prefix
        self.routing: dict[str, Any] = {
            "renormalize": renormalize,
            "scoring_func": scoring_func,
            "num_expert_group": num_expert_group,
            "topk_group": topk_group,
            "routed_scaling_factor": routed_scaling_factor,
        }
        if e_score_correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )
        else:
            self.e_score_correction_bias = None
        self.quant_method = self._method(quant_config, prefix)
        # Tensor parallelism: every rank holds every expert, with intermediate_size / tp of its
        # width (gate/up rows and down columns); the ranks' partial outputs are summed by one
        # all-reduce. A method that does not declare ``tp_shardable`` keeps whole experts on
        # every rank: correct, not split.
        from llmhal.layers.linear import divide, tp_rank_and_size

        self.tp_rank, tp = tp_rank_and_size()
        self.tp_size = tp if getattr(self.quant_method, "tp_shardable", False) else 1
        self.full_intermediate_size = intermediate_size
        local = divide(intermediate_size, self.tp_size, f"{prefix}: expert intermediate size")
        self.intermediate_size = local
        self.quant_method.create_weights(self, num_experts, hidden_size, local, params_dtype)
        if self.tp_size > 1:
            for name in ("w13_weight", "w2_weight"):
                param = getattr(self, name)
                param.weight_loader = self._rank_part(param.weight_loader)
        self._op: Callable[..., torch.Tensor] | None = None
        # The shared experts' part of the call in progress, for run_op (see forward).
        self._shared: dict[str, torch.Tensor | None] = {}

    def _rank_part(self, inner: Callable[..., None]) -> Callable[..., None]:
        """Cut an expert checkpoint tensor to this rank's slice of the intermediate dimension."""
        full, local, r = self.full_intermediate_size, self.intermediate_size, self.tp_rank
        # How the down projection stores its inputs: ``weights`` of them in ``entries`` stored
        # entries (a ggml block's weights in its bytes); the rank's slice must be whole units.
        weights, entries = getattr(self.quant_method, "w2_input_unit", (1, 1))
        if local % weights:
            raise ValueError(
                f"{self.prefix}: each rank's {local} of the experts' {full} intermediate columns "
                f"are not whole blocks of {weights}; use a tensor_parallel_size whose parts hold "
                f"whole blocks (or tensor_parallel_size=1)"
            )
        w2_start, w2_len = r * local // weights * entries, local // weights * entries

        def load(param: torch.Tensor, loaded: torch.Tensor, shard: ShardId) -> None:
            _expert, part = shard
            if part in ("w1", "w3"):  # [I, H]
                loaded = loaded.narrow(0, r * local, local)
            elif part == "w2":  # [H, I] (or [E, H, I] for every expert at once)
                loaded = loaded.narrow(loaded.dim() - 1, w2_start, w2_len)
            elif part == "w13":  # [E, 2I, H]: the rank's gate rows, then its up rows
                gate = loaded.narrow(1, r * local, local)
                up = loaded.narrow(1, full + r * local, local)
                loaded = torch.cat([gate, up], dim=1)
            inner(param, loaded, shard)

        return load

    def _method(self, quant_config: QuantizationConfig | None, prefix: str) -> FusedMoEMethodBase:
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        if method is None:
            return UnquantizedFusedMoEMethod()
        if not isinstance(method, FusedMoEMethodBase):
            raise NotImplementedError(
                f"Quantization method {quant_config.get_name()!r} has no mixture-of-experts method: "  # type: ignore[union-attr]
                f"layer {prefix or 'experts'} would get {type(method).__name__}, which runs linear "
                "layers only. MoE experts run unquantized or with quantization='experts_int8' "
                "(an unquantized checkpoint quantized to int8 while loading)."
            )
        return method

    def _resolve_op(self, w13: Any) -> Callable[..., torch.Tensor]:
        """The ``fused_moe`` kernel for these experts: the platform's, or core's reference for
        :class:`~llmhal.ops.expert_kernels.ExpertKernels` when the platform's does not take them
        (the reference always does)."""
        if self._op is None:
            from llmhal.ops.expert_kernels import accepts_expert_kernels
            from llmhal.ops.registry import get_op

            self._op = get_op("fused_moe")
            if not isinstance(w13, torch.Tensor) and not accepts_expert_kernels(self._op):
                from llmhal.ops.fused_moe import fused_moe

                self._op = fused_moe
        return self._op

    def run_op(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        router_logits: torch.Tensor,
        **scales: torch.Tensor | None,
    ) -> torch.Tensor:
        """``fused_moe`` with this layer's routing (for quantization methods' ``apply``), plus the
        shared experts' output :meth:`forward` hands the op (see there)."""
        op = self._resolve_op(w13)
        shared, self._shared = self._shared, {}  # handed on once (forward sees it was taken)
        return op(
            x,
            w13,
            w2,
            router_logits,
            self.top_k,
            e_score_correction_bias=self.e_score_correction_bias,
            activation=self.activation,
            **self.routing,
            **scales,
            **shared,
        )

    def forward(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        shared_output: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The routed experts' sum, plus ``shared_output`` (times ``sigmoid(shared_gate)`` when
        given) when the block has shared experts.

        The shared part goes into the op when the op takes it (``accepts_shared_output``) and
        this rank holds the whole sum (no tensor parallelism: the routed part is all-reduced
        below, the shared experts' layers reduce their own): there it is one native call with the
        experts. The quantization methods' ``apply`` keeps its signature; :meth:`run_op` reads the
        shared part from this call's ``_shared``."""
        fuse = (
            shared_output is not None
            and self.tp_size == 1
            and getattr(self._resolve_op(getattr(self, "w13_weight", None)),
                        "accepts_shared_output", False)
        )  # fmt: skip
        if fuse:
            self._shared = {"shared_output": shared_output, "shared_gate": shared_gate}
        try:
            out = self.quant_method.apply(self, x, router_logits)
            # A method whose apply runs a kernel of its own (an out-of-tree one) never handed the
            # shared part on through run_op: add it below rather than lose it.
            fuse = fuse and not self._shared
        finally:
            self._shared = {}
        if self.tp_size > 1:
            from llmhal.distributed.parallel_state import get_tp_group

            out = get_tp_group().all_reduce(out)
        if shared_output is not None and not fuse:
            from llmhal.ops.fused_moe import add_shared

            out = add_shared(out, shared_output, shared_gate)
        return out

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, method={type(self.quant_method).__name__}"
        )
