"""Pipeline parallelism: which layers a stage builds, its placeholders, and what stages exchange.

A model split into ``pp`` stages builds only its stage's decoder layers (a contiguous range, from
:func:`stage_layers`) and puts a :class:`PPMissingLayer` where each of the others would be, so
module names and layer indices stay those of the checkpoint. The first stage embeds the tokens;
the last normalises and computes the logits. Between stages travels an
:class:`IntermediateTensors` (for the Llama family, ``hidden_states``: the residual stream of every
token of the step, the last layer's output already added to it), sent with ``get_pp_group().send_tensor_dict(it.tensors)`` and received with
``IntermediateTensors(get_pp_group().recv_tensor_dict())``.

The model contract: ``forward(input_ids, positions, inputs_embeds=None,
intermediate_tensors=None)`` returns an :class:`IntermediateTensors` on every stage but the last
(which returns the hidden states as before); a stage other than the first is given the previous
stage's record as ``intermediate_tensors`` and ignores ``input_ids``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass
class IntermediateTensors:
    """Named tensors one pipeline stage hands to the next (e.g. ``hidden_states``)."""

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``[start, end)`` of the decoder layers stage ``pp_rank`` of ``pp_size`` builds: an even
    split, the first stages taking one more when it does not divide (they skip the LM head)."""
    if num_layers < pp_size:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} decoder layers; "
            f"use at most {num_layers} stages"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def pp_stage() -> tuple[int, int]:
    """(this process's stage, number of stages); (0, 1) when not distributed."""
    from llmhal.distributed.parallel_state import get_pp_group

    g = get_pp_group()
    return g.rank_in_group, g.world_size


class PPMissingLayer(nn.Module):
    """Stands where another stage's layer (or embedding, norm, LM head) is: no parameters, and
    calling it is an error (the model must route around it)."""

    def __init__(self, *_: Any, **__: Any) -> None:
        super().__init__()

    def forward(self, *_: Any, **__: Any) -> Any:
        raise RuntimeError(
            "this layer belongs to another pipeline stage; the stage's model must skip it"
        )


class StageClock:
    """How long this rank's pipeline stage computed: each step's time less what it spent handing
    tensors to and from its neighbour stages (mostly waiting for them). Busy seconds over wall
    seconds is the stage's busy fraction (``llmhal bench distributed`` reports it to show whether
    the stages overlap)."""

    def __init__(self) -> None:
        self.busy_seconds = 0.0

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        from llmhal.distributed.parallel_state import get_pp_group

        group = get_pp_group()
        waited, t0 = group.p2p_seconds, time.perf_counter()
        try:
            return fn(*args)
        finally:
            elapsed = time.perf_counter() - t0
            self.busy_seconds += elapsed - (group.p2p_seconds - waited)
