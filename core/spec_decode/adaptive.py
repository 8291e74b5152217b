"""Per-request adaptive speculation: stop drafting for a request whose drafts do not pay, retry later.

A verification step costs more than a decode step (on a CPU the matmuls' work grows with the rows
verified, and the proposer runs too), so drafts pay only when enough of them are accepted. Each
request's last ``window`` verifications (``min_drafts_before_disable``) are judged once that many
are in; the request stops drafting when either rule says so:

* ``disable_below_acceptance_rate``: fewer than this fraction of its draft tokens were accepted;
* ``disable_when_slower``: its tokens per verification step (1 + accepted drafts) are fewer than
  its verification steps cost in decode steps, each at its draft length. The costs are measured
  here, as the median wall time of the engine's recent steps with and without verification at the
  same number of requests and (once 3 were timed) the same longest draft (a
  step is the time from one :meth:`AdaptiveSwitch.step_done` to the next, so a step's drafting
  counts; left out are steps where a request joined, which ran its prefill, and the first step of
  each shape (batch size and draft lengths), which may have recorded its decode-step graph: 5-10x
  a replay). Where no plain step
  was seen yet at that batch size (a proposer that drafts every step), the request pauses for
  ``PROBE_STEPS`` steps to measure them, without counting that as a stop.

A verification that could not pay even with every draft accepted (its timed cost at its draft length
is at least ``drafts + 1`` decode steps) stops its request at once, without waiting for a window,
and every new request starts stopped for the longest wait.

A stopped request decodes one token a step for ``retry_after_steps`` of its steps, then drafts
again on a clean slate; each stop in a row doubles the wait (at most ``MAX_BACKOFF`` times), a
verification window that pays resets it. A failure that repeats across requests (a head or draft
model that fails or costs too much whatever the text) carries over: once the last two windows judged
were stops of two different requests, and until a window of any request pays, a new request starts
stopped, waiting as long as the last stopped request's next wait would be (failures that depend on
the text, such as n-gram drafts at a request's start, stop only that request). ``retry_after_steps=0``
stops a request for good (and carries nothing over). vLLM
turns speculation off by batch size only (``disable_by_batch_size``, also honoured); this follows
what its adaptive proposals do per request.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

# Recent step times kept per (batch size, kind): a median over these ignores the odd slow step.
STEP_SAMPLES = 16
# A stopped request's wait grows to at most this many times retry_after_steps.
MAX_BACKOFF = 16
# Plain steps a request runs to measure their cost when none was seen (StepCosts needs 3).
PROBE_STEPS = 4


@dataclass
class _RequestState:
    window: deque[tuple[int, int]]  # (draft tokens, accepted) of its recent verifications
    off_steps: int = 0  # steps left without drafting
    backoff: int = 1  # the next stop's wait, in units of retry_after_steps
    stops: int = 0


@dataclass
class StepCosts:
    """Median wall time of recent engine steps with and without verification, per batch size, and
    of verification steps per batch size and draft length (their cost grows with the rows verified:
    on a CPU a step of 6 drafts costs ~1.8 decode steps, of 2 drafts ~1.2)."""

    samples: dict[tuple[int, bool], deque[float]] = field(default_factory=dict)
    by_drafts: dict[tuple[int, int], deque[float]] = field(default_factory=dict)

    def add(self, batch: int, verified: bool, seconds: float, drafts: int = 0) -> None:
        """One step; ``drafts``: the longest draft it verified."""
        self.samples.setdefault((batch, verified), deque(maxlen=STEP_SAMPLES)).append(seconds)
        if verified and drafts:
            self.by_drafts.setdefault((batch, drafts), deque(maxlen=STEP_SAMPLES)).append(seconds)

    def known(self, batch: int, verified: bool) -> bool:
        return len(self.samples.get((batch, verified), ())) >= 3

    def ratio(self, batch: int, drafts: int | None = None, pooled: bool = True) -> float | None:
        """A verification step's cost in decode steps at ``batch`` requests (of ``drafts``-token
        drafts where at least 3 such steps were timed, else of any, or None where not
        ``pooled``); None until both kinds were seen (at least 3 each)."""
        if not (self.known(batch, True) and self.known(batch, False)):
            return None
        spec = self.by_drafts.get((batch, drafts), ()) if drafts else ()
        if len(spec) < 3:
            if not pooled:
                return None
            spec = self.samples[(batch, True)]
        return statistics.median(spec) / statistics.median(self.samples[(batch, False)])


class AdaptiveSwitch:
    """Which requests may draft now (see the module docstring)."""

    def __init__(self, rate: float, when_slower: bool, window: int, retry_after_steps: int) -> None:
        self.rate = rate
        self.when_slower = when_slower
        self.window = window
        self.retry_after_steps = retry_after_steps
        self.costs = StepCosts()
        self._requests: dict[str, _RequestState] = {}
        self._last_step: float | None = None
        self._last_ids: frozenset[str] = frozenset()
        self._verified = False  # the running step verified drafts
        self._step_drafts: list[int] = []  # its draft lengths
        self._shapes: set[tuple[int, tuple[int, ...]]] = set()  # step shapes timed before
        # 0 while new requests may draft at once, else the wait (in units of retry_after_steps)
        # a new request starts with; the request of the last verdict when it was a stop.
        self._carry = 0
        self._last_stop: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.rate) or self.when_slower

    def allows(self, request_id: str) -> bool:
        state = self._requests.get(request_id)
        if state is None and self._carry:  # a new request while the method is failing
            state = self._requests[request_id] = _RequestState(deque(maxlen=self.window))
            state.off_steps = self.retry_after_steps * self._carry
            state.backoff = min(2 * self._carry, MAX_BACKOFF)
        return state is None or state.off_steps == 0

    def all_stopped(self, request_ids: Iterable[str]) -> bool:
        """Whether none of ``request_ids`` will draft next step, and new requests start stopped
        (the latest verdict was a stop): then nobody needs the target's hidden states."""
        return bool(self._carry) and not any(self.allows(r) for r in request_ids)

    def stopped(self, request_id: str) -> bool:
        """Whether the request is waiting out a stop (for tests and statistics)."""
        return not self.allows(request_id)

    def record(self, request_id: str, num_draft_tokens: int, accepted: int, batch: int) -> None:
        """One verification of ``request_id``'s drafts, in a step of ``batch`` requests."""
        self._verified = True
        self._step_drafts.append(num_draft_tokens)
        if not self.enabled:
            return
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestState(deque(maxlen=self.window))
        state.window.append((num_draft_tokens, accepted))
        if self._hopeless(num_draft_tokens, batch):
            self._stop(state, request_id, hopeless=True)
            return
        if len(state.window) < self.window:
            return
        if self.when_slower and not self.costs.known(batch, False):
            state.window.clear()  # judged on a clean slate once plain steps were timed
            state.off_steps = PROBE_STEPS
            return
        if self._pays(state, batch):
            state.backoff = 1
            self._carry, self._last_stop = 0, None
            return
        self._stop(state, request_id)

    def _stop(self, state: _RequestState, request_id: str, hopeless: bool = False) -> None:
        state.stops += 1
        state.window.clear()
        if self.retry_after_steps == 0:
            state.off_steps = -1  # for good (never counts down to 0)
            return
        if hopeless:  # whatever the text: every request waits the longest wait
            state.backoff = MAX_BACKOFF
        state.off_steps = self.retry_after_steps * state.backoff
        state.backoff = min(2 * state.backoff, MAX_BACKOFF)
        if hopeless or (self._last_stop is not None and self._last_stop != request_id):
            self._carry = state.backoff  # two requests in a row, or drafts that cannot pay
        self._last_stop = request_id

    def _hopeless(self, drafts: int, batch: int) -> bool:
        """Whether verifying ``drafts``-token drafts at ``batch`` requests costs at least the
        ``drafts + 1`` decode steps it yields with every draft accepted (timed at that length: a
        draft model as costly as the target, whose drafting the step's time holds). No window
        can pay then, so there is no window to wait for: a few such drafts cost 4-9% of an open
        chat's speed before, where the text-dependent rules need a window per request and two
        requests' stops to carry over."""
        ratio = self.costs.ratio(batch, drafts, pooled=False) if self.when_slower and drafts else None  # fmt: skip
        return ratio is not None and ratio >= drafts + 1

    def _pays(self, state: _RequestState, batch: int) -> bool:
        drafted = sum(k for k, _ in state.window)
        accepted = sum(a for _, a in state.window)
        if self.rate and accepted < self.rate * drafted:
            return False
        if self.when_slower and self.costs.ratio(batch) is not None:
            # Each verification against what a step of its draft length costs: short drafts
            # (weak matches) cost less than the long ones that dominate a pooled median.
            cost = sum(self.costs.ratio(batch, k) for k, _ in state.window)  # type: ignore[misc]
            if len(state.window) + accepted < cost:
                return False
        return True

    def step_done(self, request_ids: Iterable[str]) -> None:
        """The engine finished a step whose sampled requests were ``request_ids`` (called once
        per step, before drafting for the next): time it. The time runs from the previous call,
        so it holds the drafting for this step too."""
        now = time.perf_counter()
        ids = frozenset(request_ids)
        shape = (len(ids), tuple(sorted(self._step_drafts)))
        if self._last_step is not None and ids and ids <= self._last_ids:
            if shape in self._shapes:
                self.costs.add(len(ids), self._verified, now - self._last_step, max(self._step_drafts, default=0))  # fmt: skip
            self._shapes.add(shape)
        self._last_step, self._last_ids, self._verified = now, ids, False
        self._step_drafts = []

    def count_down(self, request_ids: Iterable[str]) -> None:
        """After drafting for the next step: that step is one of the stopped requests' wait."""
        for rid in request_ids:
            state = self._requests.get(rid)
            if state is not None and state.off_steps > 0:
                state.off_steps -= 1

    def finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
