"""A background thread that drives an :class:`LLMEngine` for concurrent callers (the HTTP server).

Callers :meth:`EngineLoop.submit` one or more prompts (a completions request with several prompts,
or ``n`` choices) and read their :class:`RequestOutput` updates from one queue while the loop keeps
stepping every active request together (continuous batching). Prompts are validated in the caller's
thread, all of them before any is added, so bad input raises there and never reaches the engine.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from llmhal.engine.outputs import RequestOutput
from llmhal.engine.sampling_params import SamplingParams
from llmhal.engine.scheduler import check_priority
from llmhal.logger import init_logger

if TYPE_CHECKING:  # pragma: no cover  (the engine imports torch; `llmhal serve --help` need not)
    from llmhal.engine.llm_engine import LLMEngine

logger = init_logger(__name__)

# What a caller's queue yields: (index, RequestOutput) updates, index being the prompt's place in
# the submitted list; then FINISHED once every one of them has finished; or an exception.
FINISHED = object()


class EngineStopped(RuntimeError):
    """The loop was shut down: what a request in flight (or a new one) ends with."""


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cv = threading.Condition()
        # Callers pass through this turnstile while they wait for _cv, and the loop passes through
        # it before every step, so a waiting caller gets the lock between two steps. Python's locks
        # are not fair: the loop releases _cv and takes it again at once, and could keep it until
        # every request has finished, starving submissions, aborts and shutdown (a SIGTERM that
        # waited for every stream to end).
        self._turn = threading.Lock()
        # Each request's group (the caller's queue) and its index in the submitted list.
        self._routes: dict[str, tuple[_Group, int]] = {}
        self._ids = itertools.count()
        self._stop = False
        self._stop_reason = ""
        self._thread = threading.Thread(target=self._run, name="llmhal-engine-loop", daemon=True)
        self._thread.start()

    def submit(
        self,
        requests: list[tuple[str | dict[str, Any], SamplingParams]],
        sink: Any = None,
        priority: int = 0,
    ) -> tuple[list[str], Any]:
        """Validate every (prompt, params) and enqueue them together; raises ValueError/TypeError
        for bad input (then nothing was added). Returns the request ids, in order, and the queue
        of their updates: ``sink`` when given (any object with a non-blocking ``put``, called on
        the loop's thread: an asyncio server hands the updates to its event loop), else a new
        ``queue.Queue``. ``priority``: every request's (the engine's priority policy)."""
        if not requests:
            raise ValueError("no prompts were given")
        engine = self.engine
        check_priority(priority, engine.scheduler.policy)
        # Prepared here, on the caller's thread and outside the lock the loop holds while it
        # steps: tokenizing and compiling grammars must not stall everyone's decoding.
        arrival = time.monotonic()
        prepared = [engine.prepare_request(prompt, params, arrival) for prompt, params in requests]
        for prep in prepared:  # a constraint that cannot compile fails here, before any is added
            prep.wait_for_grammar()
        q = queue.Queue() if sink is None else sink
        group = _Group(q, len(prepared))
        with self._locked():
            if self._stop:
                raise EngineStopped(self._stop_reason)
            rids = [f"req-{next(self._ids)}" for _ in prepared]
            for i, (rid, prep) in enumerate(zip(rids, prepared, strict=True)):
                engine.add_request(prep, request_id=rid, priority=priority)
                self._routes[rid] = (group, i)
            self._cv.notify()
        return rids, q

    @contextlib.contextmanager
    def _locked(self) -> Any:
        with self._turn:
            self._cv.acquire()
        try:
            yield
        finally:
            self._cv.release()

    def abort(self, request_ids: list[str]) -> None:
        with self._locked():
            for rid in request_ids:
                self.engine.abort_request(rid)
                self._routes.pop(rid, None)

    def shutdown(self, reason: str = "the server is shutting down") -> int:
        """Stop stepping (a step under way finishes first) and end every request in flight with
        :class:`EngineStopped` (``reason``), so each caller can still answer its client; later
        submissions raise it too. Returns how many callers (submissions) were ended."""
        with self._locked():
            self._stop = True
            self._stop_reason = reason
            self._cv.notify()
        self._thread.join(timeout=30)
        with self._locked():
            return self._fail_all(EngineStopped(reason))

    def _run(self) -> None:
        while True:
            with self._locked():
                # Only while callers wait: an offline generate() on the same engine between
                # requests (tests compare with it) must not have its steps taken by this thread.
                while not self._stop and not (self._routes and self.engine.has_unfinished_requests()):  # fmt: skip
                    self._cv.wait()
                if self._stop:
                    return
                try:
                    outputs = self.engine.step()
                except Exception as e:  # keep serving: fail the requests in flight, not the server
                    logger.exception("Engine step failed; aborting the requests in flight")
                    self._fail_all(e)
                    continue
                for out in outputs:
                    self._deliver(out)

    def _fail_all(self, error: Exception) -> int:
        """Abort every request in flight and end each caller's queue with ``error``; returns how
        many callers there were. Holds ``_cv``."""
        groups = {id(g): g for g, _ in self._routes.values()}
        for rid in self._routes:
            self.engine.abort_request(rid)
        self._routes.clear()
        for g in groups.values():
            g.q.put(error)
        return len(groups)

    def _deliver(self, out: RequestOutput) -> None:
        route = self._routes.get(out.request_id)
        if route is None:
            return
        group, index = route
        group.q.put((index, out))
        if out.finished:
            del self._routes[out.request_id]
            group.open -= 1
            if group.open == 0:
                group.q.put(FINISHED)


class _Group:
    """One caller's submitted requests: their queue, and how many have not finished."""

    def __init__(self, q: Any, size: int) -> None:
        self.q = q
        self.open = size
