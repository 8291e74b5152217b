"""Decode-step graphs: record a pure-decode step once per batch size, then replay it.

A decode step of a small model is mostly fixed per-op cost: SmolLM2-135M's 30 layers make ~270
kernel calls, and on a CPU the Python around them (module calls, argument checks, building the
calls) took as long as the kernels at batch 1. Between two decode steps of the same batch size
only values change (the new tokens, positions, sequence lengths, block tables), never the work,
so where the platform can record a step (:meth:`Platform.capture_step_graph`: CUDA graphs, or the
CPU platform's recorded native calls) the runner keeps one graph per batch size:

* **Capture** (the first decode step of a batch size): static input buffers are filled with the
  step's values, the attention builders build their metadata from them once, and the model runs
  ``forward(None, positions, inputs_embeds)`` on them under the platform's recorder. That run is
  the step's real result. The graph is refused (and the engine runs eagerly from then on, with the
  reason logged once) when the platform cannot record the step, or when a backend's metadata holds
  tensors of its own rather than views of the static buffers (a replay would not see new values).
* **Replay**: the token embeddings are looked up eagerly (a gather, outside the graph), the
  buffers refilled (a handful of copies), and ``graph.replay()`` recomputes the output in place.

Graphs are keyed by (batch size, thread count); at most :data:`MAX_GRAPHS` are kept (least
recently used dropped), all sharing one memory pool (they never replay at once): on the CPU that is
about one layer's intermediates at the largest batch, not a whole step's per graph.

A builder whose metadata is used by graphs must read the step from the tensors it is given, not
bake values into Python scalars or trimmed shapes (``cpu_attn`` keeps the full block table and
derives nothing from sequence lengths at build time for decodes); tensors that are not views of the
static buffers are detected and refuse the graph, scalars cannot be.

Speculative decoding's verification steps are recorded the same way when every request in the step
verifies the same number of drafts: ``q`` = 1 + drafts tokens per request, keyed by (batch size,
q); its graph returns all ``b * q`` rows. A backend that cannot record such a step (refused once
per q) leaves plain decodes recorded.

A step that is not a pure decode (a prefill or a prefill chunk, verification with draft counts that
differ between requests), or whose block table does not fit the static one, runs eagerly as before.
``LLM(enforce_eager=True)`` (``--enforce-eager``) turns graphs off.

Models with recurrent layers (:mod:`llmhal.attention.state`) record their decodes too: each
request's state slot is one more static buffer (``CommonAttentionMetadata.state_indices``), refilled
per replay, and the slot of a request whose first step is this one-token decode is zeroed before the
replay, as the eager runner zeroes it. The state update kernels update the slots in place, so a
replay advances the states exactly as an eager step. Only speculative verification is never
recorded for them (the engine refuses drafts for recurrent models anyway).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmhal.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata
from llmhal.engine.request import Request
from llmhal.engine.scheduler import ScheduledBatch
from llmhal.forward_context import ForwardContext, set_forward_context
from llmhal.logger import init_logger
from llmhal.platforms import Platform, StepGraph
from llmhal.utils.tensors import tensors_in

logger = init_logger(__name__)

MAX_GRAPHS = 16


@dataclass
class _Graph:
    embeds: torch.Tensor  # [B * q, hidden]
    positions: torch.Tensor  # int64 [B * q]
    seq_lens: torch.Tensor  # int32 [B]
    computed: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, max_blocks]
    slots: torch.Tensor  # int64 [B * q]
    state_indices: torch.Tensor | None = None  # int32 [B]: recurrent models' state slots
    output: Any = None
    graph: StepGraph | None = None
    # The metadata the recorded calls point into (query_start_loc, the backends' views): kept
    # alive with the graph, or a replay would read freed memory.
    context: ForwardContext | None = None


class DecodeGraphs:
    """The runner's decode-step graphs (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        platform: Platform,
        builders: dict[str, AttentionMetadataBuilder],
        device: torch.device,
        block_size: int,
        max_model_len: int,
        hidden_size: int,
        dtype: torch.dtype,
        state_slot_of: Callable[[Request], int] | None = None,
        reset_state_slot: Callable[[int], None] | None = None,
    ) -> None:
        """``state_slot_of`` / ``reset_state_slot``: for a model with recurrent layers, a request's
        state slot, and zeroing a slot before a request's first step (None: no such layers)."""
        self.model = model
        self.state_slot_of = state_slot_of
        self.reset_state_slot = reset_state_slot
        self.platform = platform
        self.builders = builders
        self.device = device
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.hidden_size = hidden_size
        self.dtype = dtype
        self._graphs: OrderedDict[tuple[int, int, int], _Graph] = OrderedDict()
        self.refused: str | None = None  # why steps run eagerly, once a capture was refused
        # Verification query lengths (q > 1) whose capture was refused: those run eagerly.
        self.refused_q: dict[int, str] = {}
        self.pool: Any = None  # the graphs' shared memory (after the first capture)
        self.replays = 0

    def clear(self) -> None:
        """Forget every graph (their buffers, e.g. the KV cache, are about to be replaced)."""
        self._graphs.clear()

    @staticmethod
    def _query_len(batch: ScheduledBatch) -> int | None:
        """q when every request runs its last token and the same q - 1 speculative drafts (a
        pure decode: q = 1); else None."""
        q = batch.items[0][1]
        for req, n in batch.items:
            if n != q or n != 1 + len(req.spec_token_ids) or req.num_computed_tokens + 1 != req.num_tokens:  # fmt: skip
                return None
        return q

    def run(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """The step's final hidden states [B * q, hidden] through a graph, or None: run it
        eagerly."""
        if self.refused is not None or not batch.items:
            return None
        q = self._query_len(batch)
        if q is None or q in self.refused_q or (q > 1 and self.state_slot_of is not None):
            return None
        reqs = [req for req, _ in batch.items]
        if any(len(req.block_ids) > self.max_blocks for req in reqs):
            return None
        key = (len(reqs), q, torch.get_num_threads())
        g = self._graphs.get(key)
        if g is not None:
            self._graphs.move_to_end(key)
            self._fill(g, reqs, q)
            assert g.graph is not None
            g.graph.replay()
            self.replays += 1
            return g.output
        return self._capture(key, reqs)

    def _buffers(self, b: int, q: int) -> _Graph:
        dev = self.device
        return _Graph(
            embeds=torch.zeros(b * q, self.hidden_size, dtype=self.dtype, device=dev),
            positions=torch.zeros(b * q, dtype=torch.int64, device=dev),
            seq_lens=torch.zeros(b, dtype=torch.int32, device=dev),
            computed=torch.zeros(b, dtype=torch.int32),
            block_table=torch.zeros(b, self.max_blocks, dtype=torch.int32, device=dev),
            slots=torch.zeros(b * q, dtype=torch.int64, device=dev),
            state_indices=None
            if self.state_slot_of is None
            else torch.zeros(b, dtype=torch.int32, device=dev),
        )

    def _fill(self, g: _Graph, reqs: list[Request], q: int) -> None:
        bs = self.block_size
        pos = [req.num_computed_tokens for req in reqs]
        ids: list[int] = []
        slots: list[int] = []
        for req, p in zip(reqs, pos, strict=True):
            ids.append(req.token_slice(p, p + 1)[0])
            ids.extend(req.spec_token_ids)  # q - 1 drafts (checked by _query_len)
            slots.extend(req.block_ids[t // bs] * bs + t % bs for t in range(p, p + q))
        width = max(len(req.block_ids) for req in reqs)
        table = [req.block_ids + [0] * (width - len(req.block_ids)) for req in reqs]
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        g.embeds.copy_(self.model.embed_input_ids(input_ids))
        p = torch.tensor(pos, dtype=torch.int64)
        g.positions.copy_((p.unsqueeze(1) + torch.arange(q)).reshape(-1))
        g.computed.copy_(p)
        g.seq_lens.copy_(p + q)
        g.slots.copy_(torch.tensor(slots, dtype=torch.int64))
        # Columns past a request's blocks keep stale ids: kernels read ceil(seq_len / bs) of them.
        g.block_table[:, :width].copy_(torch.tensor(table, dtype=torch.int32))
        if g.state_indices is not None:
            assert self.state_slot_of is not None and self.reset_state_slot is not None
            state_slots = [self.state_slot_of(req) for req in reqs]
            for req, slot in zip(reqs, state_slots, strict=True):
                if req.num_computed_tokens == 0:  # its first step: the slot holds another's state
                    self.reset_state_slot(slot)
            g.state_indices.copy_(torch.tensor(state_slots, dtype=torch.int32))

    def _common(self, g: _Graph, b: int, q: int) -> CommonAttentionMetadata:
        qsl = torch.arange(0, b * q + 1, q, dtype=torch.int32, device=self.device)
        return CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl.cpu(),
            seq_lens=g.seq_lens,
            seq_lens_cpu=g.seq_lens.cpu(),
            num_computed_tokens_cpu=g.computed,
            block_table=g.block_table,
            slot_mapping=g.slots,
            positions=g.positions,
            num_reqs=b,
            num_actual_tokens=b * q,
            max_query_len=q,
            max_seq_len=self.max_model_len,  # an upper bound that holds for every replay
            num_decodes=b if q == 1 else 0,
            num_decode_tokens=b if q == 1 else 0,
            state_indices=g.state_indices,
        )

    def _capture(self, key: tuple[int, int, int], reqs: list[Request]) -> torch.Tensor:
        b, q = key[0], key[1]
        g = self._buffers(b, q)
        self._fill(g, reqs, q)
        common = self._common(g, b, q)
        attn = {name: builder.build(common) for name, builder in self.builders.items()}
        # Replays change the values in the static buffers only: a backend that copied them into
        # tensors of its own (a dtype change, a derived index) would not see the next step's.
        static = {t.untyped_storage().data_ptr() for t in tensors_in(common)}
        private = [
            name
            for name, meta in attn.items()
            if any(t.untyped_storage().data_ptr() not in static for t in tensors_in(meta))
        ]
        ctx = ForwardContext(common, attn)

        def step() -> Any:
            with set_forward_context(ctx):
                return self.model(None, g.positions, inputs_embeds=g.embeds)

        if private:
            out, graph = step(), None
            reason: str | None = (
                f"the {', '.join(private)} metadata holds per-step tensors of its own"
            )
        else:
            out, graph, reason = self.platform.capture_step_graph(step, self.pool)
        if graph is None:
            why = reason or "the platform recorded no graph"
            if q > 1:  # plain decodes keep their graphs
                self.refused_q[q] = why
                logger.info("Verification steps of %d tokens a request run eagerly: %s.", q, why)
            else:
                self.refused = why
                logger.info("Decode steps run eagerly: %s.", self.refused)
            return out
        g.output, g.graph, g.context = out, graph, ctx
        self.pool = graph.pool
        self._graphs[key] = g
        while len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        logger.debug("Recorded the step for batch size %d, %d token(s) each (%s).", b, q, graph)
        return out
