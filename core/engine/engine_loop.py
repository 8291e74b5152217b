"""A background thread that drives an :class:`LLMEngine` for concurrent callers (the HTTP server).

Callers :meth:`EngineLoop.submit` a prompt and read :class:`RequestOutput` updates from their own
queue while the loop keeps stepping every active request together (continuous batching). A prompt
is validated in the caller's thread, so bad input raises there and never reaches the engine.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import TYPE_CHECKING, Any

from llmhal.engine.outputs import RequestOutput
from llmhal.engine.sampling_params import SamplingParams
from llmhal.logger import init_logger

if TYPE_CHECKING:  # pragma: no cover  (the engine imports torch; `llmhal serve --help` need not)
    from llmhal.engine.llm_engine import LLMEngine

logger = init_logger(__name__)

# What a caller's queue yields: RequestOutput updates, then FINISHED; or an exception.
FINISHED = object()


class EngineStopped(RuntimeError):
    """The loop was shut down: what a request in flight (or a new one) ends with."""


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cv = threading.Condition()
        self._queues: dict[str, queue.Queue[Any]] = {}
        self._ids = itertools.count()
        self._stop = False
        self._stop_reason = ""
        self._thread = threading.Thread(target=self._run, name="llmhal-engine-loop", daemon=True)
        self._thread.start()

    def submit(
        self, prompt: str | dict[str, Any], params: SamplingParams
    ) -> tuple[str, queue.Queue[Any]]:
        """Validate and enqueue; raises ValueError/TypeError for bad input."""
        engine = self.engine
        text, ids = engine.tokenize(prompt)
        engine.check_prompt(ids, params)
        q: queue.Queue[Any] = queue.Queue()
        with self._cv:
            if self._stop:
                raise EngineStopped(self._stop_reason)
            rid = f"req-{next(self._ids)}"
            engine.add_request({"prompt": text, "prompt_token_ids": ids}, params, request_id=rid)
            self._queues[rid] = q
            self._cv.notify()
        return rid, q

    def abort(self, request_id: str) -> None:
        with self._cv:
            self.engine.abort_request(request_id)
            self._queues.pop(request_id, None)

    def shutdown(self, reason: str = "the server is shutting down") -> int:
        """Stop stepping (a step under way finishes first) and end every request in flight with
        :class:`EngineStopped` (``reason``), so each caller can still answer its client; later
        submissions raise it too. Returns how many requests were ended."""
        with self._cv:
            self._stop = True
            self._stop_reason = reason
            self._cv.notify()
        self._thread.join(timeout=30)
        with self._cv:
            ended = len(self._queues)
            for rid, q in self._queues.items():
                self.engine.abort_request(rid)
                q.put(EngineStopped(reason))
            self._queues.clear()
        return ended

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self.engine.has_unfinished_requests():
                    self._cv.wait()
                if self._stop:
                    return
                try:
                    outputs = self.engine.step()
                except Exception as e:  # keep serving: fail the requests in flight, not the server
                    logger.exception("Engine step failed; aborting the requests in flight")
                    for rid, q in list(self._queues.items()):
                        self.engine.abort_request(rid)
                        q.put(e)
                    self._queues.clear()
                    continue
                for out in outputs:
                    self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        q = self._queues.get(out.request_id)
        if q is None:
            return
        q.put(out)
        if out.finished:
            q.put(FINISHED)
            del self._queues[out.request_id]
