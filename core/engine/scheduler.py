"""Continuous batching over a paged KV cache.

Each step has a token budget (``max_num_batched_tokens``). Running requests are served first:
decodes (one token each, plus any speculative drafts), then partially prefilled prompts, which
continue with a chunk of what budget is left, each group in arrival order. While requests decode,
an engine's :class:`~llmhal.engine.step_budget.DecodePace` may limit the prompt tokens a step adds
further, so the streams keep their pace while new prompts prefill (never below a few tokens).
Waiting requests are then admitted while budget, blocks and ``max_num_seqs`` allow, their prompts
chunked to fit the budget. When a running request cannot get a block, the most recently admitted
running request is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed later (prompt plus the tokens it already generated) instead of failing. With prefix
caching, a request being admitted first takes the cached blocks of its leading tokens and is
scheduled for the rest only (a preempted one usually finds most of its own blocks still cached).
A request much of whose uncached prompt another running request is computing waits until it is
cached instead of computing it again (keeping its place in line while later requests go ahead), so
a burst of requests sharing a system prompt computes that prompt once.

Two policies, vLLM's: ``fcfs`` (the default) queues by arrival, as above. ``priority`` queues by
each request's ``priority`` (lower first), ties by arrival, a preempted request going back to its
place by the same order; and the request that gives way when blocks run out is the running one
with the highest value (lowest priority), latest arrival among equals, even if it was already
scheduled in this step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from llmhal.engine.kv_cache_manager import KVCacheManager
from llmhal.engine.request import Request, RequestStatus
from llmhal.engine.step_budget import DecodePace
from llmhal.logger import init_logger

POLICIES = ("fcfs", "priority")


def check_priority(priority: Any, policy: str) -> None:
    """vLLM's rule: a request's priority other than 0 needs the ``priority`` scheduling policy."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"priority={priority}: priority scheduling is not enabled (the engine schedules first "
            "come, first served, vLLM's fcfs policy); start it with scheduling_policy='priority' "
            "(llmhal serve --scheduling-policy priority), or send priority 0"
        )


logger = init_logger(__name__)


@dataclass
class ScheduledBatch:
    """One step: ``(request, num_new_tokens)`` pairs, decodes (1 new token) first."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool = True,
        pace: DecodePace | None = None,
        graph_chunk_tokens: int = 0,
    ) -> None:
        self.kv = kv
        # Limits a step's prompt tokens while requests decode (None: the budget alone).
        self.pace = pace
        # While requests decode under the pace, a prompt's chunk is at most this long (0: no
        # cap): the longest the runner records as a step graph beside decodes
        # (llmhal.engine.decode_graphs), so a burst of new prompts does not turn the streams'
        # steps eager. Without decodes, or with the pace off, a prompt takes the whole budget.
        self.graph_chunk_tokens = graph_chunk_tokens if chunked_prefill else 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.policy = "fcfs"

    def set_policy(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy {policy!r} is not one of {', '.join(POLICIES)} (vLLM's)")  # fmt: skip
        if self.has_unfinished():
            raise ValueError("the scheduling policy changes only while no request is queued")
        self.policy = policy

    @staticmethod
    def _order(req: Request) -> tuple[int, int]:
        return (req.priority, req.arrival_index)

    def _queue(self, request: Request) -> None:
        """Into the waiting queue at its place: by (priority, arrival) under ``priority``."""
        key = self._order(request)
        for i, other in enumerate(self.waiting):
            if self._order(other) > key:
                self.waiting.insert(i, request)
                return
        self.waiting.append(request)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        if self.policy == "priority":
            self._queue(request)
        else:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, victim: Request) -> None:
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.status = RequestStatus.PREEMPTED
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        if self.policy == "priority":
            self._queue(victim)
        else:
            self.waiting.appendleft(victim)
        logger.debug("Preempted request %s (KV cache full)", victim.request_id)

    def schedule(self, busy: frozenset[str] = frozenset(), max_reqs: int | None = None) -> ScheduledBatch:  # fmt: skip
        """The next step's batch. With pipeline parallelism several batches are in flight at
        once: ``busy`` holds the ids of requests whose last step's output is not back yet (their
        next token is unknown, and their KV is being written), which this batch skips and never
        preempts; ``max_reqs`` caps the batch's requests, so the running ones are shared among
        the batches in flight instead of all riding in the first."""
        batch = ScheduledBatch()
        limit = self.max_num_seqs if max_reqs is None else max_reqs
        budget = self.max_num_batched_tokens
        # Decodes first, then the prompts being prefilled in chunks, each group in arrival order:
        # a long prompt's chunk takes what budget the running streams leave, never their turn.
        scheduled: set[int] = set()
        decode_tokens = 0
        prefill_left: int | None = None  # the pace's limit, set once the decodes are in
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget <= 0 or len(batch.items) >= limit:
                break
            if req.status is not RequestStatus.RUNNING or req.request_id in busy:
                continue  # preempted earlier in this step, or still in the pipeline
            known = req.num_tokens - req.num_computed_tokens
            if known > 1 and prefill_left is None:
                prefill_left = self._prefill_allowance(decode_tokens, budget)
            n = min(known + len(req.spec_token_ids), budget)
            if known > 1:
                n = self._chunk_len(decode_tokens, known, n, prefill_left)  # type: ignore[arg-type]
                if n <= 0:
                    break
            if n > known and not self.kv.allocate(req, n):
                n = min(known, budget)  # no blocks for the drafts: verify none this step
            # Speculative drafts are verified after the last token, as far as the budget goes.
            del req.spec_token_ids[max(0, n - known) :]
            while not self.kv.allocate(req, n):
                victim = self._victim(scheduled, busy)
                if id(victim) in scheduled:  # priority: a lower one scheduled earlier gives way
                    scheduled.discard(id(victim))
                    budget += next(k for r, k in batch.items if r is victim)
                    batch.items = [(r, k) for r, k in batch.items if r is not victim]
                self.running.remove(victim)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            else:
                batch.items.append((req, n))
                scheduled.add(id(req))
                budget -= n
                if known > 1:
                    prefill_left -= n  # type: ignore[operator]
                else:
                    decode_tokens += n
        if prefill_left is None:
            prefill_left = self._prefill_allowance(decode_tokens, budget)
        if not batch.preempted:
            pending: set[bytes] | None = None  # blocks running requests are computing
            deferred: list[Request] = []  # waiting for those; they keep their place in line
            while self.waiting and min(budget, prefill_left) > 0 and len(self.running) < self.max_num_seqs and len(batch.items) < limit:  # fmt: skip
                req = self.waiting[0]
                prefix = self.kv.cached_prefix(req)
                if self.kv.enable_prefix_caching:
                    if pending is None:
                        pending = self.kv.pending_hashes(self.running)
                    # Much of it is being computed by another request (a burst sharing a system
                    # prompt, n > 1 children): it waits until those blocks are cached, while the
                    # requests behind it go ahead.
                    if self.kv.worth_waiting(req, len(prefix), pending):
                        deferred.append(self.waiting.popleft())
                        continue
                computed = req.num_computed_tokens + len(prefix) * self.kv.block_size
                remaining = req.num_tokens - computed
                n = self._chunk_len(decode_tokens, remaining, budget, prefill_left)
                if n <= 0 or (n < remaining and not self.chunked_prefill):
                    break
                if not self.kv.allocate(req, n, prefix):
                    break
                self.kv.record_lookup(req, len(prefix))
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                batch.items.append((req, n))
                budget -= n
                prefill_left -= n
                if pending is not None:
                    pending |= self.kv.pending_hashes([req])
            self.waiting.extendleft(reversed(deferred))
        # Backends expect decodes first; a stable sort keeps arrival order within each group.
        batch.items.sort(key=lambda item: item[1] != 1)
        return batch

    def _chunk_len(self, decode_tokens: int, remaining: int, budget: int, allowance: int) -> int:
        """The piece of a prompt with ``remaining`` tokens to prefill that a step with
        ``decode_tokens`` decoding tokens gives it, within the step's token ``budget`` and the
        pace's prompt ``allowance`` (0: none this step).

        Beside decodes a piece is the graph chunk length, or, for the prompt's last fewer tokens,
        the power of two at or below them. Graphs are keyed by their pieces' lengths
        (llmhal.engine.decode_graphs), so a step beside decodes holds whole chunks and at most a
        prompt's last piece of 4 or 2 (a piece of 1 is keyed as a decode): few shapes, recorded at
        a server's start-up (llmhal.engine.graph_warmup). The allowance is whole chunks, so it
        ends short of one only after a last piece; the next prompt then still gets a whole chunk
        (the pace is a soft limit, overshot by less than a chunk) rather than a short piece in
        mid-prompt, which would shift all its later pieces (a fresh server met a new shape every
        few steps of its first minute that way), or nothing (which left a part of the allowance
        unused after every last piece: -10% throughput at 16 streams)."""
        n = min(remaining, budget, allowance)
        # Only under the pace (a server): offline batches are judged by throughput, and 8-token
        # pieces would hold a long prompt admitted beside decodes to hundreds of steps.
        g = self.graph_chunk_tokens if self.pace is not None and self.pace.enabled else 0
        if not decode_tokens or not g or n <= 0:
            return n
        if remaining >= g and budget >= g:
            return g
        # The prompt's last piece, or a step whose token budget (a hard limit, unlike the pace)
        # leaves less than a chunk: a budget that small is a configuration choice, and waiting
        # would hold the prompt back for as long as requests decode.
        return 1 << (n.bit_length() - 1)

    def _prefill_allowance(self, decode_tokens: int, budget: int) -> int:
        """Prompt tokens this step may still take: the budget, less while requests decode.
        Without chunked prefill a prompt goes in whole, so the pace does not apply."""
        if self.pace is None or not self.chunked_prefill:
            return budget
        allowed = self.pace.prefill_allowance(decode_tokens)
        if allowed is not None and decode_tokens and self.graph_chunk_tokens:
            # Whole graph chunks (see _chunk_len): 12 allowed tokens would otherwise be a chunk
            # of 8 and one of 4, and the second's length would vary with the pace.
            g = self.graph_chunk_tokens
            allowed = max(g, allowed // g * g)
        return budget if allowed is None else min(budget, allowed)

    def _victim(self, scheduled: set[int], busy: frozenset[str] = frozenset()) -> Request:
        # A request in the pipeline never gives way (its step is writing its blocks); the one
        # being scheduled is never busy, so there is always a candidate.
        free = [r for r in self.running if r.request_id not in busy]
        if self.policy == "priority":
            return max(free, key=self._order)
        # The most recently admitted request not scheduled in this step gives way.
        return next(r for r in reversed(free) if id(r) not in scheduled)

    def finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
