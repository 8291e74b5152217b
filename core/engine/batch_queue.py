"""Batches in flight through a pipeline (vLLM's batch queue of ``max_concurrent_batches``).

With pipeline parallelism one batch at a time leaves every stage but one idle. The engine instead
keeps up to one batch per stage in flight: it submits batch k (the executor runs rank 0's first
stage and returns), schedules batch k + 1 from the requests not in flight and submits it while the
later stages work on k, and only then waits for k's output, in submission order. A request in
flight is not scheduled again until its output is back (its next token is not known yet), and is
never preempted (its step is writing its KV blocks).

The running requests are shared among the batches: a batch takes at most its share of them
(:meth:`BatchQueue.share`), so that with enough requests every stage has work, rather than the
first batch taking them all and the next finding none.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass
class InFlight:
    """A submitted batch: its executor future, when it was submitted (``time.perf_counter``) and
    the prefix-cache statistics its scheduling took."""

    batch: Any  # a ScheduledBatch
    future: Any  # a llmhal.executor.base.StepFuture
    submitted: float
    prefix_stats: Any


class BatchQueue:
    def __init__(self) -> None:
        self.pending: deque[InFlight] = deque()
        self.busy: set[str] = set()  # the ids of requests in a batch in flight
        # Batches submitted while another was in flight, and the most at once: the tests and
        # `llmhal bench distributed` read them (proof the stages overlapped, not a timing).
        self.overlapped = 0
        self.most_in_flight = 0
        self._last_done = 0.0

    def share(self, scheduler: Any, size: int) -> int:
        """The most requests one of ``size`` concurrent batches takes: an even share of the
        requests running or waiting (at least one)."""
        return max(1, math.ceil((len(scheduler.running) + len(scheduler.waiting)) / size))

    def push(self, batch: Any, future: Any, prefix_stats: Any) -> None:
        if self.pending:
            self.overlapped += 1
        self.pending.append(InFlight(batch, future, time.perf_counter(), prefix_stats))
        self.busy.update(r.request_id for r, _ in batch.items)
        self.most_in_flight = max(self.most_in_flight, len(self.pending))

    def pop(self) -> tuple[InFlight, float]:
        """The oldest batch, and the time its step's cost counts from: its submission, or the
        previous batch's completion if later (overlapping batches must not count twice, or
        tokens/s would read low)."""
        flight = self.pending.popleft()
        self.busy.difference_update(r.request_id for r, _ in flight.batch.items)
        return flight, max(flight.submitted, self._last_done)

    def done(self) -> None:
        """The popped batch's output has been handed to its requests."""
        self._last_done = time.perf_counter()


def drop_finished(batch: Any, results: Any) -> tuple[Any, Any]:
    """A batch's results without the requests that finished while it was in flight (aborted: an
    abort frees a request at once; its rows are dropped, like its output)."""
    import torch

    logits, sample_reqs, prompt_lps = results
    if not any(r.status.finished for r, _ in batch.items):
        return batch, results
    batch.items = [(r, n) for r, n in batch.items if not r.status.finished]
    keep = [i for i, r in enumerate(sample_reqs) if not r.status.finished]
    if logits is not None:
        logits = logits.index_select(0, torch.tensor(keep, dtype=torch.long, device=logits.device))
    sample_reqs = [sample_reqs[i] for i in keep]
    if not sample_reqs:
        logits = None
    prompt_lps = [(r, e) for r, e in prompt_lps if not r.status.finished]
    return batch, (logits, sample_reqs, prompt_lps)
