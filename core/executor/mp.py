"""``mp``: ranks 1..N-1 as local processes (multiprocessing 'spawn'); rank 0 is the engine's own.

Each step rank 0 pickles the step's inputs once (a ModelRunner ``StepInput``: token ids, lengths,
block tables; a few hundred bytes for a decode) and writes them to every worker's pipe, then runs
its own shard; the collectives inside the model pair the ranks up. With pipeline stages, the last
stage's first rank sends the step's output back through its pipe, and up to one step per stage is
in flight (:meth:`MultiprocExecutor.submit_model`): rank 0 computes the first stage of step k + 1
while the later stages work on step k.

Faults: a monitor thread waits on the workers' process sentinels. A worker that dies (or raises:
it reports the traceback through its pipe, then exits) is recorded with its rank and cause, and
every other worker is stopped; rank 0, blocked in a collective with it, gets an error from gloo
(the peer's sockets closed) and :meth:`execute_model` raises :class:`EngineDeadError`. A worker
whose pipe from rank 0 closes (rank 0 exited, even by SIGKILL) exits itself, and ignores SIGINT:
Ctrl-C reaches the whole process group, and rank 0 decides what stops.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from llmhal.executor.base import DoneStep, EngineDeadError, Executor, StepFuture
from llmhal.logger import init_logger

logger = init_logger(__name__)

# A worker's traceback is cut to this many characters: a pipe holds ~64 KiB before its writer
# blocks, and a worker that blocks there would never exit.
_MAX_ERROR_CHARS = 8000
# How long rank 0, after a collective failed, waits for the monitor to name the worker behind it.
_BLAME_WAIT_S = 5.0
# How long rank 0 waits for the workers, all past their imports, to connect to the process group
# (not the init's own 30 minutes: a worker that died on the way would hold rank 0 that long).
_JOIN_TIMEOUT_S = 60.0
# How long a failing worker waits for its error report to be read before it exits anyway (rank 0
# reads it when it next waits for this worker; it may be blocked elsewhere until this one exits).
_ERROR_FLUSH_S = 5.0


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped responding"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


class _Outbox:
    """A worker's messages to rank 0, written by a thread of their own. With batches in flight,
    the last stage may finish step k while rank 0 computes the first stage of step k + 1 and then
    hands its tensors to the next stage: an output larger than the pipe holds (logits are
    vocabulary-sized) written by the worker's own thread would wait for rank 0 to read it, while
    rank 0 waits for this rank to take the tensors."""

    def __init__(self, conn: Any) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, args=(conn,), daemon=True)
        self._thread.start()

    def send(self, message: Any, wait: bool = True) -> None:
        """Queue ``message``; ``wait``: until it is written (a step's output need not wait; a
        worker that dies right after reporting 'joining' must have reported it)."""
        sent = threading.Event() if wait else None
        self._queue.put((message, sent))
        while sent is not None and not sent.wait(0.5):
            if not self._thread.is_alive():  # it stopped at a broken pipe: rank 0 is gone
                raise BrokenPipeError("rank 0's pipe is closed")

    def _loop(self, conn: Any) -> None:
        while (item := self._queue.get()) is not None:
            message, sent = item
            try:
                conn.send(message)
            except OSError:  # rank 0 is gone; the worker's reads say so too
                return
            finally:
                if sent is not None:
                    sent.set()

    def flush(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds: rank 0 may not be reading) for what was sent."""
        self._queue.put(None)
        self._thread.join(timeout)


def _worker_main(args: Any, parallel: Any, rank: int, init_method: str, conn: Any) -> None:
    """A worker process's life: load, then run what rank 0 sends until its pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from llmhal.executor.worker import Worker

    worker = Worker(args, parallel, rank, init_method)
    outbox = _Outbox(conn)
    # The last stage's first rank reports each step's output (rank 0 itself with one stage).
    reports = rank == (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size
    try:
        blocks = worker.load(before_join=lambda: outbox.send(("joining", None)))
        outbox.send(("ready", blocks))
        while True:
            kind, payload = conn.recv()  # EOFError: rank 0 has gone
            if kind == "step":
                out = worker.execute(payload)
                if reports:
                    outbox.send(("output", out), wait=False)
            elif kind == "alloc":
                outbox.send(("allocated", worker.allocate(payload)))
            elif kind == "busy":
                outbox.send(("busy", worker.clock.busy_seconds))
            elif kind == "stop":
                break
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(0)  # rank 0 is gone: nothing to report to, and no collective to finish
    except BaseException as e:
        text = "".join(traceback.format_exception(e))[-_MAX_ERROR_CHARS:]
        cause = f"raised {type(e).__name__}: {e}"
        try:
            outbox.send(("error", (cause[:_MAX_ERROR_CHARS], text)), wait=False)
            outbox.flush(_ERROR_FLUSH_S)
        finally:
            os._exit(1)  # skip interpreter teardown: a process group with dead peers can hang it
    outbox.flush(_ERROR_FLUSH_S)
    worker.close()
    os._exit(0)


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _stop(procs: list[Any], conns: list[Any], stopping: threading.Event) -> None:
    """Stop the workers: close their pipes (an idle worker exits on that), then SIGTERM, then
    SIGKILL what is left. Bounded: a few seconds at most. ``stopping`` tells the monitor thread
    that these exits are asked for (this also runs at interpreter exit, without shutdown())."""
    stopping.set()
    for c in conns:
        try:
            c.send(("stop", None))
        except (OSError, ValueError):
            pass
        c.close()
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)


class MultiprocExecutor(Executor):
    def initialize(self, build_shard: Callable[[], Any]) -> None:
        from llmhal.distributed.launch import free_port
        from llmhal.executor.worker import check_no_engine_here

        check_no_engine_here()  # before any worker starts
        par = self.config.parallel
        init = f"tcp://127.0.0.1:{free_port()}"
        ctx = multiprocessing.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._locks: list[threading.Lock] = []
        self._stopping = threading.Event()  # set by _stop: the workers' exits are asked for
        self.steps, self.dispatch_seconds, self.dispatch_bytes = 0, 0.0, 0
        from llmhal.distributed.pipeline import StageClock

        self.clock = StageClock()  # rank 0's busy seconds (llmhal bench distributed)
        self._blocks: list[int] = []
        for rank in range(1, par.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(self.args, par, rank, init, child),
                name=f"llmhal-rank{rank}",
                daemon=True,  # multiprocessing stops it when this process exits normally
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
            self._locks.append(threading.Lock())
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns, self._stopping)
        for rank in range(1, par.world_size):
            try:
                self._recv(rank, "joining")  # past imports and config: joining cannot hang
            except EngineDeadError as e:
                if "raised" in e.cause:
                    raise
                # It died before running any of llmhal's code: most often 'spawn' re-running
                # an unguarded script, which then failed to start a process of its own.
                raise EngineDeadError(
                    e.rank,
                    f"{e.cause} while starting (a worker process imports the main script: "
                    "guard the code that creates the LLM with `if __name__ == '__main__':`)",
                ) from None
        self._join_watching_workers(init)
        self._joined = True
        self.runner = build_shard()
        self._blocks = [self._recv(rank, "ready") for rank in range(1, par.world_size)]
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._monitor = threading.Thread(target=self._watch, name="llmhal-mp-monitor", daemon=True)
        self._monitor.start()
        # The last stage's first rank reports each step's output (rank 0 when there is one stage).
        self._output_rank = (par.pipeline_parallel_size - 1) * par.tensor_parallel_size
        # One step per stage in flight: rank 0 runs the first stage of the next while the later
        # stages work on earlier ones. Outputs come back in order (the step counts check it).
        self.max_concurrent_batches = self._stages = par.pipeline_parallel_size
        self._submitted = self._collected = 0

    def _join_watching_workers(self, init: str) -> None:
        """Join the process group as rank 0, within _JOIN_TIMEOUT_S. Joining waits for every
        rank to connect; a worker that dies between reporting 'joining' and connecting would
        otherwise leave rank 0 waiting out torch's init timeout (30 minutes). Every worker has
        reported 'joining' by now, so a live one connects within seconds; when the join gives
        up, the worker that died is named."""
        from llmhal.executor.worker import join_process_group

        try:
            join_process_group(self.config, 0, init, _JOIN_TIMEOUT_S)
        except Exception:
            dead = [rank for rank, p in enumerate(self._procs, start=1) if not p.is_alive()]
            if not dead:
                raise
            failure = self._record_exit(dead[0])
            raise EngineDeadError(failure.rank, f"{failure.cause} while joining the process group") from None  # fmt: skip

    @property
    def worker_pids(self) -> list[int]:
        """Ranks 1..N-1's process ids, in rank order."""
        return [p.pid for p in self._procs]

    # ----------------------------------------------------------------------- messages
    def _fail(
        self, rank: int, cause: str, detail: str = "", notify: bool = True
    ) -> EngineDeadError:
        if self._failure is None:
            if detail:
                logger.error("rank %d failed:\n%s", rank, detail)
            self._failure = EngineDeadError(rank, cause)
        if notify:
            self._run_failure_callbacks()  # once: it empties the list
        return self._failure

    def _recv(self, rank: int, kind: str) -> Any:
        """The next message from ``rank``, which must be ``kind``; EngineDeadError if the worker
        reports an error or dies first."""
        conn, proc = self._conns[rank - 1], self._procs[rank - 1]
        while True:
            wait([conn, proc.sentinel])
            with self._locks[rank - 1]:
                if conn.poll():
                    try:
                        got, payload = conn.recv()
                    except EOFError:
                        got, payload = None, None
                    if got == kind:
                        return payload
                    if got == "error":
                        raise self._fail(rank, *payload)
                    if got is not None:
                        raise self._fail(rank, f"sent {got!r} where {kind!r} was expected")
            if not proc.is_alive():
                proc.join()
                raise self._fail(rank, describe_exit(proc.exitcode))

    def _record_exit(self, rank: int) -> EngineDeadError:
        """Fail the engine with the exited worker ``rank``'s cause: the error it reported, else
        how it exited."""
        proc, conn = self._procs[rank - 1], self._conns[rank - 1]
        proc.join()
        for _ in range(50):  # two threads reaping one child: the loser reads None until the
            if proc.exitcode is not None:  # winner has stored the status
                break
            time.sleep(0.01)
        # Read and record under the pipe's lock: the monitor thread and a failed step can both get
        # here, and the one that finds the pipe empty must not record "exited with status 1"
        # before the other has recorded the error the worker sent.
        with self._locks[rank - 1]:
            try:
                msg = conn.recv() if conn.poll() else None
            except (EOFError, OSError):
                msg = None
            if msg is not None and msg[0] == "error":
                failure = self._fail(rank, *msg[1], notify=False)
            else:
                failure = self._fail(rank, describe_exit(proc.exitcode), notify=False)
        self._run_failure_callbacks()  # outside the lock: a callback may stop the engine
        return failure

    def _watch(self) -> None:
        """The monitor thread: the first worker to exit unasked fails the engine."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs, start=1)}
        ready = wait([*sentinels, self._wake_r])
        if self._stopping.is_set() or self._wake_r in ready:
            return
        self._record_exit(min(sentinels[s] for s in ready))
        logger.error("%s", self._failure)
        self._shutdown_workers()

    def _blame(self, error: BaseException) -> EngineDeadError:
        """The error a failed step raises: the worker that failed (a worker's death reaches rank 0
        as a broken collective or pipe, perhaps before it has fully exited), else rank 0 itself."""
        deadline = time.monotonic() + _BLAME_WAIT_S
        while self._failure is None and time.monotonic() < deadline:
            dead = [r for r, p in enumerate(self._procs, start=1) if not p.is_alive()]
            if dead:
                self._record_exit(dead[0])
                break
            wait([p.sentinel for p in self._procs], timeout=0.05)
        failure = self._failure or self._fail(0, f"raised {type(error).__name__}: {error}")
        self._shutdown_workers()
        return failure

    # ------------------------------------------------------------------------- contract
    def determine_num_blocks(self) -> int:
        from llmhal.engine.builder import kv_blocks_fitting
        from llmhal.platforms import get_current_platform

        own = kv_blocks_fitting(self.config, self.runner, get_current_platform())
        return min([own, *self._blocks])

    def _send_all(self, data: bytes) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(data)
            except (OSError, ValueError) as e:  # its pipe broke: it died
                raise self._blame(e) from None

    def allocate(self, num_blocks: int) -> int:
        self.check_health()
        self._send_all(pickle.dumps(("alloc", num_blocks)))
        own = self.runner.allocate_kv_cache(num_blocks)
        others = [self._recv(rank, "allocated") for rank in range(1, len(self._procs) + 1)]
        return self._record_memory(own, others)

    def execute_model(self, batch: Any) -> Any:
        return self.submit_model(batch).result()

    def submit_model(self, batch: Any) -> StepFuture:
        """Send the step to every worker and run rank 0's own part; with pipeline stages that is
        the first stage, and the step's output comes later through the last stage's pipe (the
        future's result), so rank 0 can start the next step meanwhile."""
        self.check_health()
        runner = self.runner
        step, owners = runner.prepare(batch)  # uni does this too
        t0 = time.perf_counter()
        data = pickle.dumps(("step", step), protocol=pickle.HIGHEST_PROTOCOL)
        self._send_all(data)
        # What fanning the step out costs rank 0 (llmhal bench distributed reports it per step).
        self.dispatch_seconds += time.perf_counter() - t0
        self.dispatch_bytes += len(data)
        self.steps += 1
        # Rank 0's stage busy time matters with pipeline stages only (bench distributed's figure);
        # without them the step runs unclocked (with the clock, `llmhal generate -tp 2` aborted
        # at exit 1 run in 3 here, "terminate called without an active exception"; not found why).
        run = self.clock.run if self._stages > 1 else _call
        out = self._guarded(run, runner.run, step)
        if out is not None:
            return DoneStep(runner.finish(owners, out))
        # An earlier pipeline stage: the last one reports the output.
        self._submitted += 1
        return _PipelineStep(self, owners, self._submitted)

    def _collect(self, owners: Any, seq: int) -> Any:
        self.check_health()
        if seq != self._collected + 1:
            raise RuntimeError(
                f"pipeline step {seq} collected before step {self._collected + 1}: the stages "
                "report outputs in the order steps were submitted"
            )
        out = self._guarded(self._recv, self._output_rank, "output")
        self._collected = seq
        return self.runner.finish(owners, out)

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` as part of a step: any failure ends the engine, naming the rank behind
        it, and stops the workers."""
        try:
            return fn(*args)
        except EngineDeadError:
            self._shutdown_workers()
            raise
        except Exception as e:
            raise self._blame(e) from e
        except BaseException:
            # Ctrl-C mid-step: the other ranks are still inside this step's collectives, so the
            # next step could never pair up with them. The engine ends here.
            self._fail(0, "was interrupted in the middle of a step")
            self._shutdown_workers()
            raise

    def stage_busy_seconds(self) -> list[float]:
        """Each rank's seconds computing steps so far (handing tensors between pipeline stages
        left out), in rank order; call it between steps, with none in flight."""
        self.check_health()
        self._send_all(pickle.dumps(("busy", None)))
        workers = [self._recv(rank, "busy") for rank in range(1, len(self._procs) + 1)]
        return [self.clock.busy_seconds, *workers]

    def _shutdown_workers(self) -> None:
        self._finalizer()  # runs _stop once, which sets _stopping first
        wake = getattr(self, "_wake_w", None)
        if wake is not None:
            try:
                wake.send_bytes(b"x")
            except OSError:
                pass

    def shutdown(self) -> None:
        if not hasattr(self, "_procs"):
            return  # initialize never ran
        self._shutdown_workers()
        if self._joined:  # never another engine's group
            from llmhal.distributed import destroy_distributed

            destroy_distributed()


class _PipelineStep(StepFuture):
    """A step whose output the last pipeline stage will send; the ``seq``-th submitted."""

    def __init__(self, executor: MultiprocExecutor, owners: Any, seq: int) -> None:
        self._executor, self._owners, self._seq = executor, owners, seq

    def result(self) -> Any:
        return self._executor._collect(self._owners, self._seq)
