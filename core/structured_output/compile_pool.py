"""The parent's side of the structured-output compile processes (the worker is
:mod:`llmhal.structured_output.compile_worker`).

A bounded set of worker processes, started on first use and reused: a compile thread takes an
idle worker (or starts one while fewer than ``size`` exist, or waits), sends its request and
reads the answer; the thread waits in a read that releases the GIL, so decoding goes on. The
workers are started with ``python -m`` (not multiprocessing): nothing is pickled either way, and
the caller's ``__main__`` is not imported again in them. A worker that dies fails the request it
was serving (RuntimeError, with its exit status) and is replaced by the next request.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import weakref
from typing import Any

from llmhal.structured_output.compile_worker import receive, send


class ConstraintRefused(ValueError):
    """The library in the worker could not compile the constraint (its own message)."""


class _Died(RuntimeError):
    """The worker process ended (it has been reaped; the pool drops it)."""


class _Process:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmhal.structured_output.compile_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.known: set[str] = set()  # the vocabularies sent to it

    def call(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        try:
            send(self.proc.stdin, header, payload)  # type: ignore[arg-type]
            answer = receive(self.proc.stdout)  # type: ignore[arg-type]
        except (OSError, EOFError):
            answer = None
        if answer is None:
            self.kill()
            raise _Died(
                f"the structured-output compile process ended (exit status {self.proc.returncode}) "
                "while compiling this constraint; a new one serves the next request"
            )
        return answer

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:  # what was left to flush to a dead worker's pipe
                pass


def _kill_all(processes: set[_Process]) -> None:
    for p in list(processes):
        p.kill()
    processes.clear()


class CompileProcesses:
    """At most ``size`` worker processes, shared by a manager's compile threads."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[_Process] = []
        self._all: set[_Process] = set()
        self._closed = False
        self.started = 0  # workers started so far (for tests)
        # Workers end with their parent's pipe; killed at once when the pool is closed or dropped.
        self._finalizer = weakref.finalize(self, _kill_all, self._all)

    def call(
        self,
        header: dict[str, Any],
        payload: bytes = b"",
        vocabulary: tuple[str, bytes] | None = None,
    ) -> tuple[dict[str, Any], bytes]:
        """The worker's answer to one request; ``vocabulary`` (key, outlines-core's binary form)
        is sent first to a worker that does not have it yet. Raises ConstraintRefused when the
        library refused the constraint, RuntimeError when the worker failed."""
        self._slots.acquire()
        proc = None
        try:
            proc = self._take()
            if vocabulary is not None and vocabulary[0] not in proc.known:
                self._answer(proc.call({"op": "vocabulary", "key": vocabulary[0]}, vocabulary[1]))
                proc.known.add(vocabulary[0])
            return self._answer(proc.call(header, payload))
        except _Died:
            if proc is not None:
                with self._lock:
                    self._all.discard(proc)
                proc = None
            raise
        finally:
            if proc is not None:
                with self._lock:
                    if self._closed:
                        proc.kill()
                    else:
                        self._idle.append(proc)
            self._slots.release()

    @staticmethod
    def _answer(answer: tuple[dict[str, Any], bytes]) -> tuple[dict[str, Any], bytes]:
        header, payload = answer
        if "refused" in header:
            raise ConstraintRefused(header["refused"])
        if "error" in header:
            raise RuntimeError(f"the structured-output compile process failed: {header['error']}")
        return header, payload

    def _take(self) -> _Process:
        with self._lock:
            if self._closed:
                raise RuntimeError("the structured-output compile processes were shut down")
            if self._idle:
                return self._idle.pop()
        proc = _Process()  # outside the lock: another thread may take an idle one meanwhile
        with self._lock:
            self._all.add(proc)
            self.started += 1
        return proc

    def close(self) -> None:
        """Kill every worker (a compile in flight fails with RuntimeError)."""
        with self._lock:
            self._closed = True
            self._idle.clear()
            _kill_all(self._all)
