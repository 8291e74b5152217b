"""What the mixture-of-experts decoders share: the sparse block and expert-aware weight loading.

A MoE decoder is the Llama decoder whose MLP is, on some layers, a router (``gate``, a plain linear
to one logit per expert) and a :class:`~llmhal.layers.fused_moe.FusedMoE` (``experts``). The models
(``mixtral.py``, ``qwen2_moe.py``, ``qwen3_moe.py``) only say which layers are sparse and how they
route; to the engine they are ordinary decoder models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from llmhal.layers.fused_moe import FusedMoE, RouterLinear, ShardId, route_expert_tensor
from llmhal.layers.weights import WeightLoadError
from llmhal.models.llama import LlamaForCausalLM, LlamaMLP
from llmhal.models.utils import LLAMA_STACKED, StackedParam, load_weights_by_name


class SparseMoeBlock(nn.Module):
    """``experts(x, gate(x))``: the router's logits pick ``top_k`` experts per token."""

    def __init__(self, hidden_size: int, num_experts: int, prefix: str, **moe: Any) -> None:
        super().__init__()
        self.gate = RouterLinear(hidden_size, num_experts, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(
            num_experts, hidden_size=hidden_size, prefix=f"{prefix}.experts", **moe
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


def num_experts(config: Any) -> int:
    """The number of routed experts (``num_local_experts`` in Mixtral, ``num_experts`` in Qwen)."""
    for attr in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(config, attr, None)
        if value:
            return int(value)
    raise ValueError("the model's config names no number of experts (num_local_experts, ...)")


def topk_moe_block(config: Any, prefix: str, *, renormalize: bool) -> SparseMoeBlock:
    """The plain sparse block of a config: all its experts at ``intermediate_size``, the
    ``num_experts_per_tok`` best per token, its ``hidden_act`` (models differ only in whether the
    chosen weights are renormalized)."""
    return SparseMoeBlock(
        config.hidden_size,
        num_experts(config),
        prefix,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.intermediate_size,
        renormalize=renormalize,
        activation=config.hidden_act,
    )


class MoeForCausalLM(LlamaForCausalLM):
    """Base of the MoE decoders: subclasses implement :meth:`build_mlp` and may rename checkpoint
    tensors in :meth:`rename_checkpoint_tensor`."""

    @classmethod
    def build_mlp(cls, config: Any, layer_idx: int, prefix: str) -> nn.Module:
        """The MLP of layer ``layer_idx``: a sparse block, or a dense MLP on dense layers."""
        raise NotImplementedError

    @classmethod
    def layer_options(cls, config: Any, layer_idx: int) -> dict[str, Any]:
        return {
            **super().layer_options(config, layer_idx),
            "build_mlp": partial(cls.build_mlp, config, layer_idx),
        }

    @staticmethod
    def dense_mlp(config: Any, prefix: str, intermediate_size: int | None = None) -> nn.Module:
        return LlamaMLP(config, intermediate_size=intermediate_size, prefix=prefix)

    def rename_checkpoint_tensor(self, name: str) -> str:
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = ((self.rename_checkpoint_tensor(n), t) for n, t in weights)
        return load_moe_weights(self, renamed, LLAMA_STACKED)


def load_moe_weights(
    model: LlamaForCausalLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: Sequence[StackedParam],
) -> set[str]:
    """Load a MoE decoder built on Llama's stack (the models here, DeepSeek's): ``weights``
    (checkpoint names, already renamed) filtered to this pipeline stage as in
    ``LlamaForCausalLM.load_weights``, the expert tensors into the FusedMoE layers (checked
    complete), the rest by name through ``stacked``; a tied LM head's tensors are not loaded twice."""
    ignored = ("lm_head.",) if model.lm_head is model.model.embed_tokens else ()
    experts = _ExpertLoader(model)
    loaded = load_weights_by_name(
        model, experts.split(model._stage_weights(weights)), stacked=stacked,
        ignored_prefixes=ignored,
    )  # fmt: skip
    return loaded | experts.finish()


class _ExpertLoader:
    """Takes the expert tensors out of a checkpoint stream and loads them into the FusedMoE layers,
    then checks that every expert of every layer got its three projections."""

    def __init__(self, model: nn.Module) -> None:
        self.params = dict(model.named_parameters())
        self.layers = {n: m for n, m in model.named_modules() if isinstance(m, FusedMoE)}
        self.shards: dict[str, set[ShardId]] = {}
        self.unstacked: set[str] = set()  # parameters filled through load_expert_tensor

    def split(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            routed = route_expert_tensor(name)
            if routed is None:
                yield name, tensor
                continue
            target, shard = routed
            param = self.params.get(target)
            try:
                if param is None:
                    self.unstacked.add(self._load_unstacked(name, target, tensor, shard))
                else:
                    loader: Callable[..., None] = param.weight_loader  # type: ignore[attr-defined]
                    loader(param, tensor, shard)
            except WeightLoadError as e:
                raise WeightLoadError(f"checkpoint tensor {name!r} -> {target}: {e}") from None
            self.shards.setdefault(target, set()).add(shard)

    def _load_unstacked(self, name: str, target: str, tensor: torch.Tensor, shard: ShardId) -> str:
        """An expert tensor with no stacked parameter: the layer's method loads it, if it can;
        returns the name of the parameter it filled."""
        layer_name, _, tensor_name = target.rpartition(".")
        layer = self.layers.get(layer_name)
        if layer is None:
            raise WeightLoadError(
                f"checkpoint tensor {name!r} is an expert weight, but the model has no MoE "
                f"layer {layer_name!r} (MoE layers: {', '.join(self.layers) or 'none'})"
            )
        load = getattr(layer.quant_method, "load_expert_tensor", None)
        if load is None:
            raise WeightLoadError(
                f"the experts of {layer_name} load as {layer.quant_method.describe(layer)}, which "
                f"has no tensor {tensor_name!r}: the checkpoint's experts are stored in a format "
                "its quantization_config does not give them (or that llmhal cannot read for "
                "experts: see docs/quantization.md)"
            )
        return f"{layer_name}.{load(layer, tensor_name, tensor, shard)}"

    def finish(self) -> set[str]:
        for name, layer in self.layers.items():
            for param, parts in (("w13_weight", ("w1", "w3")), ("w2_weight", ("w2",))):
                if f"{name}.{param}" not in self.params:
                    continue  # per-expert layers: each checks its own tensors after loading
                got = self.shards.get(f"{name}.{param}", set())
                if (None, parts[0] if len(parts) == 1 else "w13") in got:
                    continue
                missing = [
                    f"{e}.{p}" for e in range(layer.num_experts) for p in parts if (e, p) not in got
                ]
                if got and missing:
                    raise WeightLoadError(
                        f"{name}: the checkpoint lacks expert tensors {', '.join(missing[:8])}"
                        + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
                    )
        return {n for n in self.shards if n in self.params} | self.unstacked
