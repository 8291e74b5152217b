"""Runs one scheduled step through the model.

It flattens the batch into one varlen token sequence, builds positions and slot mappings
(:func:`llmhal.attention.batch.build_common_metadata`), asks each attention backend's builder for its
metadata, runs the model under the forward context, and computes logits only for the last token of
each request that completes its known tokens this step (the rows that are sampled), and for the
prompt positions of requests that asked for prompt log-probabilities.
"""

from __future__ import annotations

import math
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
        if self.state_layers:
            selections = [m.selection for m in [*self.layers, *self.state_layers]]
            check_explicit_choice(selections, config.attention_backend)
        self.builders: dict[str, AttentionMetadataBuilder] = {}
        for layer in [*self.layers, *self.state_layers]:
            name = layer.backend.name
            if name not in self.builders:
                self.builders[name] = layer.backend.get_builder_cls()(layer.requirements, device)
        self.num_blocks = 0
        self.decode_graphs = self._decode_graphs()

    def _decode_graphs(self) -> DecodeGraphs | None:
        """Graphs for pure-decode steps where the platform records them and the model can start
        from embeddings (see :mod:`llmhal.engine.decode_graphs`); None: every step runs eagerly."""
        platform = get_current_platform()
        if self.config.model.enforce_eager or not platform.capabilities.graphs:
            return None
        if self.state_layers:
            # A replay would need the step's state slots in a static buffer too; not recorded yet.
            logger.info(
                "Decode-step graphs are off: the model has recurrent layers (%s), whose state "
                "slots the recorded steps do not carry; decodes run eagerly",
                ", ".join(sorted({m.kind for m in self.state_layers})),
            )
            return None
        if type(platform).capture_step_graph is Platform.capture_step_graph:
            return None  # the capability is declared, the recorder not (yet) implemented
        if not hasattr(self.model, "embed_input_ids"):
            return None
        hf = self.config.model.hf_config
        return DecodeGraphs(
            self.model, platform, self.builders, self.device, self.block_size,
            self.config.model.max_model_len, hf.hidden_size, self.config.model.dtype,
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
        if self.decode_graphs is not None and not any(r.pooling for r, _ in batch.items):
            hidden = self.decode_graphs.run(batch)
            if hidden is not None:  # a decode or uniform verification: every row is sampled
                logits = self.model.compute_logits(hidden)
                return logits.float(), [req for req, _ in batch.items], []
        ids: list[int] = []
        query_lens, computed, tables = [], [], []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        # (request, first hidden row, first position): prompt positions whose next token's
        # log-probability is still missing (after a preemption, recomputed ones are not).
        prompt_spans: list[tuple[Request, int, int, int]] = []
        pool_spans: list[tuple[Request, int, int, int]] = []  # (request, first row, n, position)
        offset = 0
        for req, n in batch.items:
            start = req.num_computed_tokens
            known = min(start + n, req.num_tokens)
            ids.extend(req.token_slice(start, known))
            # Speculative drafts follow the last token; each one's row is sampled too.
            ids.extend(req.spec_token_ids[: start + n - known])
            query_lens.append(n)
            computed.append(start)
            tables.append(req.block_ids)
            if req.prompt_logprobs is not None:
                first = max(start, len(req.prompt_logprobs) - 1)
                end = min(start + n, len(req.prompt_token_ids) - 1)  # position p predicts p + 1
                if first < end:
                    prompt_spans.append((req, offset + first - start, first, end))
            if req.pooling is not None:  # its hidden states go to its pooler, never sampled
                pool_spans.append((req, offset, n, start))
                offset += n
                continue
            offset += n
            if known == req.num_tokens:
                sample_rows.extend(range(offset - 1 - (start + n - known), offset))
                sample_reqs.append(req)
        common = build_common_metadata(query_lens, computed, tables, self.block_size, self.device)
        if self.state_layers:
            slots = [self.state_cache.slot_of(req) for req, _ in batch.items]
            common.state_indices = torch.tensor(slots, dtype=torch.int32, device=self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        ctx = ForwardContext(common, {name: b.build(common) for name, b in self.builders.items()})
        with set_forward_context(ctx):
            hidden = self.model(input_ids, common.positions)
        prompt_lps = [(r, self._prompt_logprobs(hidden, r, *span)) for r, *span in prompt_spans]
        for req, row, n, start in pool_spans:
            req.pooling.add(hidden[row : row + n], start)
        if not sample_rows:
            return None, [], prompt_lps
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        return logits.float(), sample_reqs, prompt_lps

    def _prompt_logprobs(
        self, hidden: torch.Tensor, req: Request, row: int, first: int, end: int
    ) -> list[dict[int, Logprob]]:
        """Entries for prompt tokens first + 1 .. end (hidden rows row .. row + end - first)."""
        k = req.params.prompt_logprobs or 0
        out: list[dict[int, Logprob]] = []
        for a in range(first, end, PROMPT_LOGITS_ROWS):
            b = min(end, a + PROMPT_LOGITS_ROWS)
            h = hidden[row + a - first : row + b - first]
            lp = torch.log_softmax(self.model.compute_logits(h).float(), -1)
            targets = req.prompt_token_ids[a + 1 : b + 1]
            out.extend(logprob_entries(lp, targets, [k] * len(targets)))
        return out
