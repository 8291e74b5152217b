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

Graphs are keyed by (each request's query length, thread count); at most :data:`MAX_GRAPHS` are kept (least
recently used dropped), all sharing one memory pool (they never replay at once): on the CPU that is
about one layer's intermediates at the largest batch, not a whole step's per graph.

A builder whose metadata is used by graphs must read the step from the tensors it is given, not
bake values into Python scalars or trimmed shapes (``cpu_attn`` keeps the full block table and
derives nothing from sequence lengths at build time for decodes); tensors that are not views of the
static buffers are detected and refuse the graph, scalars cannot be.

Speculative decoding's verification steps are recorded the same way: a request verifying ``q - 1``
drafts is ``q`` rows, and its graph returns every row. A backend that cannot record a verification
of ``q`` rows (refused once per q) leaves plain decodes recorded.

**Mixed steps.** Where the platform says its attention reads short query runs from the metadata's
tensors too (``PlatformCapabilities.graph_chunk_tokens``, 8 on the CPU), a step whose requests mix
decodes, verifications of different lengths and prompt chunks of up to that many tokens is recorded
as well, keyed by its query lengths. That is what a server under load runs: new prompts prefill in
short chunks beside the running streams (the scheduler caps a prompt's chunk at this length while
requests decode), and an eager step of 16 decodes plus 12 prompt tokens took 58 ms on the default
model where the decode-only graph took 20 ms. The runner samples only the rows that end a request's
known tokens, as in an eager step.

A step with a longer prompt chunk, a request that wants prompt log-probabilities or is pooled, or
whose block table does not fit the static one, runs eagerly as before. ``LLM(enforce_eager=True)``
(``--enforce-eager``) turns graphs off.

Models with recurrent layers (:mod:`llmhal.attention.state`) record their decodes too: each
request's state slot is one more static buffer (``CommonAttentionMetadata.state_indices``), refilled
per replay, and the slot of a request whose first step is this one-token decode is zeroed before the
replay, as the eager runner zeroes it. The state update kernels update the slots in place, so a
replay advances the states exactly as an eager step. Only single-row steps are recorded for them:
verification (the engine refuses drafts for recurrent models anyway) and prompt chunks, whose state
update is a scan, run eagerly.
"""

from __future__ import annotations

import itertools
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

# Graphs kept (least recently used dropped). A server records 84 shapes at start-up (decode counts
# up to 64, each beside 0-2 prompt chunks or a prompt's last piece, llmhal.engine.graph_warmup) and
# may meet a few more (two prompts' last pieces in one step, a third chunk); a graph's own memory is
# its static inputs and the recorded calls, its intermediates live in the shared pool.
MAX_GRAPHS = 128


def _padded_decodes(d: int) -> int:
    """The recorded decode count that serves ``d`` decodes: 1, 2, 3, 4, 6, 8, 12, 16, 24, ...

    Mixed steps are keyed by their decode count and their prompt chunks; at 16 streams every count
    from 0 to 16 occurs beside each chunk pattern, and each new key costs a capture (about an
    eager step, 2-3x a replay). Padding the count to this ladder keeps the keys few at ~12% more
    rows on average. A padding row repeats the last decode (its token, position, KV slot and
    block table): it writes the same key and value to the same slot and its output is dropped,
    so no request can see it."""
    if d <= 4:
        return d
    top = 1 << (d - 1).bit_length()  # the power of two at or above d
    return top * 3 // 4 if d <= top * 3 // 4 else top


@dataclass
class _Graph:
    embeds: torch.Tensor  # [rows, hidden]
    positions: torch.Tensor  # int64 [rows]
    seq_lens: torch.Tensor  # int32 [B]
    computed: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, max_blocks]
    slots: torch.Tensor  # int64 [rows]
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
        chunk_tokens: int = 0,
        state_slot_of: Callable[[Request], int] | None = None,
        reset_state_slot: Callable[[int], None] | None = None,
    ) -> None:
        """``chunk_tokens``: the longest prompt chunk recorded beside decodes (0: decodes and
        uniform verification only; see ``PlatformCapabilities.graph_chunk_tokens``).
        ``state_slot_of`` / ``reset_state_slot``: for a model with recurrent layers, a request's
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
        self._graphs: OrderedDict[tuple[tuple[int, ...], int], _Graph] = OrderedDict()
        self.refused: str | None = None  # why steps run eagerly, once a capture was refused
        # Query lengths (q > 1) whose capture was refused: steps with a request of q rows run
        # eagerly.
        self.refused_q: dict[int, str] = {}
        # Recurrent layers scan a chunk's tokens: their steps are recorded one row a request.
        self.chunk_tokens = 0 if state_slot_of is not None else chunk_tokens
        self.pool: Any = None  # the graphs' shared memory (after the first capture)
        self.replays = 0
        self.captures = 0

    def recorded_shapes(self) -> list[tuple[int, ...]]:
        """The query lengths (one per request) of the steps recorded now, oldest use first."""
        return [qs for qs, _ in self._graphs]

    def clear(self) -> None:
        """Forget every graph (their buffers, e.g. the KV cache, are about to be replaced)."""
        self._graphs.clear()

    def _query_lens(self, batch: ScheduledBatch) -> tuple[int, ...] | None:
        """Each request's rows when the step can be recorded (see the module docstring); None:
        run it eagerly."""
        qs = tuple(n for _, n in batch.items)
        for req, n in batch.items:
            if req.spec_token_ids:  # a verification: the last token and every draft
                if n != 1 + len(req.spec_token_ids) or req.num_computed_tokens + 1 != req.num_tokens:  # fmt: skip
                    return None
            elif (
                n > 1 or req.num_computed_tokens + 1 != req.num_tokens
            ):  # not a decode: a prompt chunk
                if n > self.chunk_tokens:
                    return None  # a length this platform does not record beside decodes
                if req.prompt_logprobs is not None:
                    return None  # its prompt log-probabilities are computed eagerly
        if not self.chunk_tokens and any(q != qs[0] for q in qs):
            return None  # verifications of different lengths need the mixed-step capability
        if any(q in self.refused_q for q in qs):
            return None
        return qs

    def run(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """The step's final hidden states (every row, in the batch's order) through a graph, or
        None: run it eagerly."""
        if self.refused is not None or not batch.items:
            return None
        qs = self._query_lens(batch)
        if qs is None or (self.state_slot_of is not None and max(qs) > 1):
            return None
        reqs = [req for req, _ in batch.items]
        if any(len(req.block_ids) > self.max_blocks for req in reqs):
            return None
        # Decodes come first (the scheduler's contract); with mixed steps their count is padded
        # up the ladder by repeating the last one (see _padded_decodes).
        d = next((i for i, q in enumerate(qs) if q > 1), len(qs))
        pad = _padded_decodes(d) - d if self.chunk_tokens and self.state_slot_of is None else 0
        if pad:
            reqs[d:d] = [reqs[d - 1]] * pad
            qs = (1,) * (d + pad) + qs[d:]
        key = (qs, torch.get_num_threads())
        g = self._graphs.get(key)
        if g is not None:
            self._graphs.move_to_end(key)
            self._fill(g, reqs, qs)
            assert g.graph is not None
            g.graph.replay()
            self.replays += 1
            out = g.output
        else:
            out = self._capture(key, reqs)
        if not pad:
            return out
        return out[:d] if d + pad == len(qs) else torch.cat([out[:d], out[d + pad :]])

    def _buffers(self, b: int, n: int) -> _Graph:
        """Static inputs for ``b`` requests and ``n`` rows."""
        dev = self.device
        return _Graph(
            embeds=torch.zeros(n, self.hidden_size, dtype=self.dtype, device=dev),
            positions=torch.zeros(n, dtype=torch.int64, device=dev),
            seq_lens=torch.zeros(b, dtype=torch.int32, device=dev),
            computed=torch.zeros(b, dtype=torch.int32),
            block_table=torch.zeros(b, self.max_blocks, dtype=torch.int32, device=dev),
            slots=torch.zeros(n, dtype=torch.int64, device=dev),
            state_indices=None
            if self.state_slot_of is None
            else torch.zeros(b, dtype=torch.int32, device=dev),
        )

    def _fill(self, g: _Graph, reqs: list[Request], qs: tuple[int, ...]) -> None:
        bs = self.block_size
        pos = [req.num_computed_tokens for req in reqs]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for req, p, q in zip(reqs, pos, qs, strict=True):
            if req.spec_token_ids:  # the last token, then the q - 1 drafts (_query_lens checked)
                ids.append(req.token_slice(p, p + 1)[0])
                ids.extend(req.spec_token_ids)
            else:
                ids.extend(req.token_slice(p, p + q))
            rows = range(p, p + q)
            positions.extend(rows)
            slots.extend(req.block_ids[t // bs] * bs + t % bs for t in rows)
        width = max(len(req.block_ids) for req in reqs)
        table = [req.block_ids + [0] * (width - len(req.block_ids)) for req in reqs]
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        g.embeds.copy_(self.model.embed_input_ids(input_ids))
        p = torch.tensor(pos, dtype=torch.int64)
        g.positions.copy_(torch.tensor(positions, dtype=torch.int64))
        g.computed.copy_(p)
        g.seq_lens.copy_(p + torch.tensor(qs))
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

    def _common(self, g: _Graph, qs: tuple[int, ...]) -> CommonAttentionMetadata:
        b, n = len(qs), sum(qs)
        qsl = torch.tensor([0, *itertools.accumulate(qs)], dtype=torch.int32, device=self.device)
        # Single-row requests count as decodes (they come first, the scheduler's contract).
        decodes = next((i for i, q in enumerate(qs) if q > 1), b)
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
            num_actual_tokens=n,
            max_query_len=max(qs),
            max_seq_len=self.max_model_len,  # an upper bound that holds for every replay
            num_decodes=decodes,
            num_decode_tokens=decodes,
            state_indices=g.state_indices,
        )

    def _capture(self, key: tuple[tuple[int, ...], int], reqs: list[Request]) -> torch.Tensor:
        qs = key[0]
        g = self._buffers(len(qs), sum(qs))
        self._fill(g, reqs, qs)
        common = self._common(g, qs)
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
            q = max(qs)
            if q > 1:  # plain decodes keep their graphs
                self.refused_q[q] = why
                logger.info("Steps with %d-token query runs run eagerly: %s.", q, why)
            else:
                self.refused = why
                logger.info("Decode steps run eagerly: %s.", self.refused)
            return out
        self.captures += 1  # recorded ones only
        g.output, g.graph, g.context = out, graph, ctx
        self.pool = graph.pool
        self._graphs[key] = g
        while len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        logger.debug("Recorded the step of query lengths %s (%s).", qs, graph)
        return out
