"""Runs one scheduled step through the model.

It flattens the batch into one varlen token sequence, builds positions and slot mappings
(:func:`llmhal.attention.batch.build_common_metadata`), asks each attention backend's builder for its
metadata, runs the model under the forward context, and computes logits only for the last token of
each request that completes its known tokens this step (the rows that are sampled), and for the
prompt positions of requests that asked for prompt log-probabilities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmhal.attention.backend import AttentionMetadataBuilder
from llmhal.attention.batch import build_common_metadata
from llmhal.attention.layer import Attention
from llmhal.attention.state import RecurrentLayer, check_explicit_choice, recurrent_layers
from llmhal.config import EngineConfig
from llmhal.engine.decode_graphs import DecodeGraphs
from llmhal.engine.outputs import Logprob
from llmhal.engine.request import Request
from llmhal.engine.sampler import logprob_entries
from llmhal.engine.scheduler import ScheduledBatch
from llmhal.engine.state_cache import plan_caches
from llmhal.forward_context import ForwardContext, set_forward_context
from llmhal.logger import init_logger
from llmhal.platforms import Platform, get_current_platform

logger = init_logger(__name__)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache tensor. In host memory it comes from calloc, whose pages the OS zeroes on
    first touch, so a large budget costs neither start-up time nor resident memory until used.
    (Zeros, not garbage: masked-out slots must not hold NaNs that 0 * NaN would spread.)"""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


# Prompt positions turned into logits at a time for prompt log-probabilities: the logits of a long
# prompt chunk at once would be rows x vocab floats (2048 x 49152 x 4 bytes = 400 MB for SmolLM2).
PROMPT_LOGITS_ROWS = 256

PromptLogprobs = list[tuple[Request, list[dict[int, Logprob]]]]


@dataclass
class StepInput:
    """One step's model inputs as plain data (no Request objects), so a parallel executor can
    send it to the other ranks: the flattened token ids, each request's query length, tokens
    already computed and block table, the hidden rows to sample, prompt spans that need
    log-probabilities ``(first row, first position, end position, top-k, targets)``, and rows to
    pool ``(first row, rows)``."""

    input_ids: list[int]
    query_lens: list[int]
    computed: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]
    prompt_spans: list[tuple[int, int, int, int, list[int]]]
    pool_spans: list[tuple[int, int]]
    # Each request's slot in the recurrent layers' state cache (empty without such layers), and
    # the slots to zero before the step: requests starting with a one-token step, which runs as a
    # decode, and decode kernels continue whatever state the slot holds.
    state_slots: list[int] = field(default_factory=list)
    fresh_slots: list[int] = field(default_factory=list)
    # Requests verifying a draft tree: (index in the step, its DraftTree), all of one shape.
    trees: list[tuple[int, Any]] = field(default_factory=list)


@dataclass
class StepOwners:
    """Who a :class:`StepInput`'s rows belong to; stays in the process that owns the requests."""

    sample: list[Request]
    prompt: list[Request]
    pool: list[tuple[Request, int]]  # (request, first position of its rows)


@dataclass
class StepOutput:
    """What a step computed: logits of the sampled rows (None: none sampled), each prompt span's
    log-probability entries, and each pooled span's hidden rows."""

    logits: torch.Tensor | None
    prompt_logprobs: list[list[dict[int, Logprob]]]
    pooled: list[torch.Tensor]


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights held, asking quantization methods for what they keep outside parameters.

    A module whose tensors were all counted already (a tied LM head) is not counted twice.
    """
    total = 0
    counted: set[int] = set()
    for module in model.modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        method = getattr(module, "quant_method", None)
        if method is not None:
            if not (own and all(id(t) in counted for t in own)):
                total += method.weight_bytes(module)
        else:
            total += sum(t.numel() * t.element_size() for t in own if id(t) not in counted)
        counted.update(id(t) for t in own)
    return total


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.block_size = config.cache.block_size
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        # Layers with a per-request state (llmhal.attention.state); the engine's StateCacheManager
        # (state_cache) gives each running request its slot in them.
        self.state_layers: list[RecurrentLayer] = recurrent_layers(model)
        self.state_cache: Any = None
        self.num_state_slots = 0
        if not self.layers and not self.state_layers:
            raise ValueError(
                f"{type(model).__name__} has neither llmhal Attention layers nor recurrent layers; "
                "cannot allocate a cache"
            )
        selections = [m.selection for m in [*self.layers, *self.state_layers]]
        check_explicit_choice(selections, config.attention_backend)
        self.builders: dict[str, AttentionMetadataBuilder] = {}
        for layer in [*self.layers, *self.state_layers]:
            name = layer.backend.name
            if name not in self.builders:
                self.builders[name] = layer.backend.get_builder_cls()(layer.requirements, device)
        self.num_blocks = 0
        from llmhal.distributed import get_pp_group

        self._pp = get_pp_group()  # the trivial group of one unless pipeline-parallel
        caps = get_current_platform().capabilities
        # The longest prompt chunk a step graph may hold beside decodes (the scheduler caps chunks
        # at it while requests decode under the pace). It depends on whether steps can be
        # recorded here at all, never on enforce_eager, so eager and recorded runs schedule the
        # same steps; recurrent layers scan a chunk, so their steps are recorded one row a request
        # and chunks are not capped.
        recordable = self._can_record()
        self.graph_chunk_tokens = (
            caps.graph_chunk_tokens if recordable and not self.state_layers else 0
        )
        eager = self.config.model.enforce_eager or not recordable
        self.decode_graphs = None if eager else self._decode_graphs()
        # Set by a speculative method that drafts from the target's hidden states (EAGLE): each
        # step then keeps every row's hidden state (or the layer inputs the model was asked to
        # keep, see set_aux_hidden_state_layers) for the engine to hand on; such steps run eagerly.
        self.capture_hidden = False
        self.captured_hidden: torch.Tensor | None = None
        # Speculative draft trees by request (the Speculator's ``trees``; see
        # llmhal.spec_decode.tree_verify): a request verifying a whole tree runs with the tree mask
        # and its nodes' depths as positions. ``tree_rows``: the last step's first row of each.
        self.draft_trees: dict[str, Any] = {}
        self.tree_rows: dict[str, int] = {}

    def _can_record(self) -> bool:
        """Whether steps can be recorded here at all, whatever enforce_eager says."""
        platform = get_current_platform()
        if not platform.capabilities.graphs:
            return False
        if self.config.parallel.world_size > 1:
            # A recorded step replays its kernels, not the collectives between ranks (gloo's run
            # outside any graph), and every rank would have to replay in lockstep: run eagerly.
            return False
        if type(platform).capture_step_graph is Platform.capture_step_graph:
            return False  # the capability is declared, the recorder not (yet) implemented
        return hasattr(self.model, "embed_input_ids")  # a step starts from embeddings

    def _decode_graphs(self) -> DecodeGraphs:
        """Graphs for the steps the platform records (see :mod:`llmhal.engine.decode_graphs`);
        built only where :meth:`_can_record` and enforce_eager is off."""
        hf = self.config.model.hf_config
        # Recurrent layers: the graphs carry each request's state slot (see decode_graphs); the
        # engine hands the runner its state cache after this.
        slots = (
            (lambda req: self.state_cache.slot_of(req), self.reset_state_slot)
            if self.state_layers
            else ()
        )
        return DecodeGraphs(
            self.model, get_current_platform(), self.builders, self.device, self.block_size,
            self.config.model.max_model_len, hf.hidden_size, self.config.model.dtype,
            self.graph_chunk_tokens, *slots,
        )  # fmt: skip

    @property
    def attention_backends(self) -> list[str]:
        return list(self.builders)

    def _layer_cache_spec(
        self, layer: Attention, num_blocks: int
    ) -> tuple[tuple[int, ...], torch.dtype]:
        cache_dtype = self.config.cache.kv_cache_dtype
        shape = layer.backend.get_kv_cache_shape(
            num_blocks, self.block_size, layer.num_kv_heads, layer.head_size, cache_dtype
        )
        dtype = layer.backend.kv_cache_torch_dtype(self.config.model.dtype, cache_dtype)
        return tuple(shape), dtype

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights (:func:`model_weight_bytes` of its shard)."""
        return model_weight_bytes(self.model)

    def kv_cache_bytes_per_block(self) -> int:
        total = 0
        for layer in self.layers:
            shape, dtype = self._layer_cache_spec(layer, 1)
            total += math.prod(shape) * dtype.itemsize
        return total

    def blocks_fitting(self, budget: int) -> int:
        """The KV blocks ``budget`` bytes hold beside the recurrent layers' states; the state
        slots planned with them (:func:`llmhal.engine.state_cache.plan_caches`) are allocated by
        :meth:`allocate_kv_cache` and kept in ``num_state_slots``."""
        sched = self.config.scheduler
        plan = plan_caches(
            budget, self.kv_cache_bytes_per_block(), self.state_bytes_per_slot(),
            sched.max_num_seqs, self.config.model.max_model_len, self.block_size,
        )  # fmt: skip
        self.num_state_slots = plan.num_slots
        return plan.num_blocks

    def state_bytes_per_slot(self) -> int:
        """Bytes of recurrent state one request takes (every recurrent layer's specs)."""
        return sum(spec.nbytes for m in self.state_layers for spec in m.state_specs())

    def allocate_state_cache(self, num_slots: int) -> int:
        """Give every recurrent layer its state tensors ([num_slots, *spec.shape] each); returns
        the bytes allocated."""
        total = 0
        for m in self.state_layers:
            m.states = tuple(
                _zeros((num_slots, *spec.shape), spec.dtype, self.device)
                for spec in m.state_specs()
            )
            total += sum(t.numel() * t.element_size() for t in m.states)
        return total

    def reset_state_slot(self, slot: int) -> None:
        """Zero ``slot`` in every recurrent layer (a request is starting in it)."""
        for m in self.state_layers:
            for t in m.states:
                t[slot].zero_()

    def allocate_kv_cache(self, num_blocks: int) -> int:
        """Give every attention layer its cache tensor, and every recurrent layer its states
        (``num_state_slots`` of them, planned by :meth:`blocks_fitting`); returns the bytes
        allocated."""
        total = self.allocate_state_cache(self.num_state_slots) if self.state_layers else 0
        for layer in self.layers:
            shape, dtype = self._layer_cache_spec(layer, num_blocks)
            layer.kv_cache = _zeros(shape, dtype, self.device)
            total += layer.kv_cache.numel() * layer.kv_cache.element_size()
        self.num_blocks = num_blocks
        if self.decode_graphs is not None:
            self.decode_graphs.clear()  # recorded steps point into the old caches
        return total

    def execute(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor | None, list[Request], PromptLogprobs]:
        """Run the step; returns the logits for the sampled rows, the requests they belong to, and
        the prompt log-probabilities this step computed (per request that asked, in order). A
        request verifying speculative drafts has ``1 + len(spec_token_ids)`` rows, in order."""
        # A one-token pooling prompt looks like a decode, but is pooled, not sampled.
        eager = self.capture_hidden or any(r.pooling or r.request_id in self.draft_trees for r, _ in batch.items)  # fmt: skip
        if self.decode_graphs is not None and not eager:
            hidden = self.decode_graphs.run(batch)
            if hidden is not None:
                return self._sample_graph_rows(batch, hidden)
        step, owners = self.prepare(batch)
        return self.finish(owners, self.run(step))

    def prepare(self, batch: ScheduledBatch) -> tuple[StepInput, StepOwners]:
        """The step as plain data (what every rank runs; see :class:`StepInput`) and, kept on
        this process, the requests its sampled rows, prompt spans and pooled rows belong to."""
        step = StepInput([], [], [], [], [], [], [])
        owners = StepOwners([], [], [])
        offset = 0
        self.tree_rows = {}
        for req, n in batch.items:
            start = req.num_computed_tokens
            known = min(start + n, req.num_tokens)
            tree = self.draft_trees.get(req.request_id) if req.spec_token_ids else None
            if tree is not None and n == 1 + tree.num_nodes == 1 + len(req.spec_token_ids):
                step.trees.append((len(step.query_lens), tree))  # untrimmed: verified as a tree
                self.tree_rows[req.request_id] = offset
            step.input_ids.extend(req.token_slice(start, known))
            # Speculative drafts follow the last token; each one's row is sampled too.
            step.input_ids.extend(req.spec_token_ids[: start + n - known])
            step.query_lens.append(n)
            step.computed.append(start)
            step.block_tables.append(req.block_ids)
            if self.state_layers:
                slot = self.state_cache.slot_of(req)
                step.state_slots.append(slot)
                if start == 0 and n == 1:
                    step.fresh_slots.append(slot)
            if req.prompt_logprobs is not None:
                # Prompt positions whose next token's log-probability is still missing (after a
                # preemption, recomputed ones are not).
                first = max(start, len(req.prompt_logprobs) - 1)
                end = min(start + n, len(req.prompt_token_ids) - 1)  # position p predicts p + 1
                if first < end:
                    k = req.params.prompt_logprobs or 0
                    targets = req.prompt_token_ids[first + 1 : end + 1]
                    step.prompt_spans.append((offset + first - start, first, end, k, targets))
                    owners.prompt.append(req)
            if req.pooling is not None:  # its hidden states go to its pooler, never sampled
                step.pool_spans.append((offset, n))
                owners.pool.append((req, start))
                offset += n
                continue
            offset += n
            rows = _sampled_rows(req, n, offset)
            if rows:
                step.sample_rows.extend(rows)
                owners.sample.append(req)
        return step, owners

    def _sample_graph_rows(
        self, batch: ScheduledBatch, hidden: torch.Tensor
    ) -> tuple[torch.Tensor | None, list[Request], PromptLogprobs]:
        """:meth:`execute`'s answer for a step a graph ran: the logits of the rows that end a
        request's known tokens (with its drafts), as :meth:`prepare` picks them."""
        rows: list[int] = []
        owners: list[Request] = []
        offset = 0
        for req, n in batch.items:
            offset += n
            mine = _sampled_rows(req, n, offset)
            if mine:
                rows.extend(mine)
                owners.append(req)
        if not rows:
            return None, [], []
        if len(rows) < hidden.shape[0]:  # a prompt chunk's rows are not sampled
            hidden = hidden.index_select(0, torch.tensor(rows, device=hidden.device))
        return self.model.compute_logits(hidden).float(), owners, []

    def _run_stage(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """This pipeline stage's layers; the hidden states on the last stage, else None (the
        stage's IntermediateTensors went to the next stage)."""
        from llmhal.distributed.pipeline import IntermediateTensors

        pp = self._pp
        inter = None if pp.is_first_rank else IntermediateTensors(pp.recv_tensor_dict())
        out = self.model(input_ids, positions, intermediate_tensors=inter)
        if pp.is_last_rank:
            return out
        pp.send_tensor_dict(out.tensors)
        return None

    def run(self, step: StepInput) -> StepOutput | None:
        """Run the model on one step's inputs: every rank of a parallel group calls this with the
        same ``step`` (the collectives inside the model pair them up). None on a pipeline stage
        before the last (its output went on to the next stage)."""
        tree = step.trees[0][1] if step.trees else None
        common = build_common_metadata(
            step.query_lens, step.computed, step.block_tables, self.block_size, self.device,
            tree_mask=None if tree is None else tree.mask,
        )  # fmt: skip
        if tree is not None:
            _tree_positions(common, step)
        for slot in step.fresh_slots:
            self.reset_state_slot(slot)
        if step.state_slots:
            common.state_indices = torch.tensor(
                step.state_slots, dtype=torch.int32, device=self.device
            )
        input_ids = torch.tensor(step.input_ids, dtype=torch.long, device=self.device)
        ctx = ForwardContext(common, {name: b.build(common) for name, b in self.builders.items()})
        with set_forward_context(ctx):
            if self._pp.world_size == 1:
                hidden = self.model(input_ids, common.positions)
            else:  # a pipeline stage: from the previous stage's tensors, on to the next
                hidden = self._run_stage(input_ids, common.positions)
                if hidden is None:
                    return None
        if self.capture_hidden:
            taps = getattr(self.model, "aux_hidden_states", None)
            self.captured_hidden = torch.cat(taps, -1) if taps else hidden
        prompt_lps = [self._prompt_logprobs(hidden, *span) for span in step.prompt_spans]
        pooled = [hidden[row : row + n] for row, n in step.pool_spans]
        if not step.sample_rows:
            return StepOutput(None, prompt_lps, pooled)
        rows = torch.tensor(step.sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        return StepOutput(logits.float(), prompt_lps, pooled)

    @staticmethod
    def finish(
        owners: StepOwners, out: StepOutput
    ) -> tuple[torch.Tensor | None, list[Request], PromptLogprobs]:
        """Hand a step's results back to its requests: pooled rows to their poolers; returns what
        :meth:`execute` does."""
        for (req, start), rows in zip(owners.pool, out.pooled, strict=True):
            req.pooling.add(rows, start)
        prompt_lps = list(zip(owners.prompt, out.prompt_logprobs, strict=True))
        return out.logits, owners.sample if out.logits is not None else [], prompt_lps

    def _prompt_logprobs(
        self, hidden: torch.Tensor, row: int, first: int, end: int, k: int, targets: list[int]
    ) -> list[dict[int, Logprob]]:
        """Entries for prompt tokens first + 1 .. end (hidden rows row .. row + end - first), each
        with the top ``k``; ``targets`` are those prompt tokens."""
        out: list[dict[int, Logprob]] = []
        for a in range(first, end, PROMPT_LOGITS_ROWS):
            b = min(end, a + PROMPT_LOGITS_ROWS)
            h = hidden[row + a - first : row + b - first]
            lp = torch.log_softmax(self.model.compute_logits(h).float(), -1)
            chunk = targets[a - first : b - first]
            out.extend(logprob_entries(lp, chunk, [k] * len(chunk)))
        return out


def _sampled_rows(req: Request, n: int, end: int) -> range | None:
    """The rows of ``req`` to sample in a step where it runs ``n`` tokens ending at row ``end``:
    its last known token's and its drafts', when the step reaches its last known token."""
    start = req.num_computed_tokens
    known = min(start + n, req.num_tokens)
    if known != req.num_tokens:
        return None
    return range(end - 1 - (start + n - known), end)


def _tree_positions(common: Any, step: StepInput) -> None:
    """A tree verification's nodes sit at ``computed + depth`` (their KV slots stay in node order,
    see llmhal.spec_decode.tree_verify), and only the requests verifying a tree get the tree mask
    (a prefill chunk of the tree's length keeps the causal rule)."""
    shape = step.trees[0][1]
    positions = common.positions.clone()
    flags = torch.zeros(common.num_reqs, dtype=torch.bool)
    starts = common.query_start_loc_cpu
    for i, tree in step.trees:
        if tree != shape:
            raise RuntimeError("draft trees of different shapes in one step")
        first = int(starts[i])
        depths = torch.tensor(tree.depths, device=positions.device)
        positions[first : first + len(depths)] = step.computed[i] + depths
        flags[i] = True
    common.positions = positions
    common.tree_requests = flags.to(positions.device)
