"""The executor contract: how the engine runs a step on every rank of its model.

Members, in the order the engine calls them:

``initialize(build_shard)``
    Start the other ranks (if any), join the process group, and call ``build_shard()`` in this
    process: it loads this process's shard and returns its ``ModelRunner`` (then ``runner``).
``determine_num_blocks() -> int``
    The KV-cache blocks every rank can hold: the smallest of the ranks' own numbers.
``allocate(num_blocks) -> int``
    Give every rank its KV cache of ``num_blocks`` blocks; returns this rank's bytes, and sets
    ``memory`` to every rank's :class:`RankMemory` summed: what the engine holds, which
    ``LLM.load_report`` gives (a tensor replicated on each rank, such as MLA's latent cache or
    a replicated layer's weights under tensor parallelism, counts once per rank that holds it).
``execute_model(batch) -> (logits, sampled requests, prompt log-probabilities)``
    Run one scheduled step on every rank (``ModelRunner.execute``'s result, on the rank that owns
    the requests). Raises :class:`EngineDeadError` once any rank has failed.
``max_concurrent_batches`` (an int attribute)
    How many steps may be in flight at once: 1, or the number of pipeline stages where the
    executor can overlap them (vLLM's name). The engine reads it each step; setting it to 1
    runs one batch at a time (the benchmark's baseline).
``submit_model(batch) -> StepFuture``
    Start a step and return before its output is back (after this process ran its own stage,
    where it runs the first one): ``future.result()`` is what ``execute_model`` returns. Futures
    are resolved in the order they were submitted. By default the step runs to the end here.
``check_health()``
    Raise :class:`EngineDeadError` if a rank has failed.
``shutdown()``
    Stop every other rank; idempotent, and safe after a failure.
``register_failure_callback(callback)``
    ``callback()`` runs once, on any thread, when a rank fails (vLLM's hook; ``llmhal serve``
    stops on it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple


class RankMemory(NamedTuple):
    """What one rank holds (or, summed, every rank): KV-cache bytes, KV bytes per block, and
    weight bytes."""

    kv_bytes: int = 0
    kv_bytes_per_block: int = 0
    weight_bytes: int = 0

    @classmethod
    def total(cls, ranks: Iterable[tuple[int, int, int]]) -> RankMemory:
        return cls(*(sum(column) for column in zip(*ranks, strict=True)))

    @classmethod
    def of(cls, runner: Any, kv_bytes: int) -> RankMemory:
        """A rank's record: its runner's figures beside the KV bytes it allocated."""
        return cls(kv_bytes, runner.kv_cache_bytes_per_block(), runner.weight_bytes())


class EngineDeadError(RuntimeError):
    """A rank failed (died, or raised): the engine cannot run another step. ``rank`` is the
    global rank that failed, ``cause`` what happened to it."""

    def __init__(self, rank: int, cause: str) -> None:
        super().__init__(
            f"rank {rank} of the engine failed: {cause}. The engine's other processes were "
            f"stopped; start a new engine"
        )
        self.rank = rank
        self.cause = cause


class StepFuture:
    """A submitted step (vLLM's future from ``execute_model(non_block=True)``); :meth:`result`
    waits for its output and raises :class:`EngineDeadError` if a rank failed meanwhile."""

    def result(self) -> Any:
        raise NotImplementedError


class DoneStep(StepFuture):
    """A step whose output is already here."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value


class Executor(ABC):
    """Runs the model's ranks. ``config`` is the engine's config (``config.parallel`` the layout;
    this process's rank in it), ``args`` the EngineArgs it came from."""

    def __init__(self, config: Any, args: Any) -> None:
        self.config = config
        self.args = args
        self.runner: Any = None
        self._failure_callbacks: list[Callable[[], None]] = []
        self._failure: EngineDeadError | None = None
        self._joined = False  # this executor joined the process's group (so it leaves it)
        self.max_concurrent_batches = 1

    @property
    def failure(self) -> EngineDeadError | None:
        """The error of the rank that failed (None while every rank is well)."""
        return self._failure

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        self._failure_callbacks.append(callback)

    def _run_failure_callbacks(self) -> None:
        callbacks, self._failure_callbacks = self._failure_callbacks, []
        for callback in callbacks:
            callback()

    @abstractmethod
    def initialize(self, build_shard: Callable[[], Any]) -> None: ...

    @abstractmethod
    def determine_num_blocks(self) -> int: ...

    # Every rank's memory, summed; set by allocate.
    memory: RankMemory = RankMemory()

    def _record_memory(self, own: int, others: Iterable[tuple[int, int, int]] = ()) -> int:
        """Set ``memory`` from this rank's allocated KV bytes and the other ranks' records, as
        their workers' ``allocate`` returns them; returns ``own`` (allocate's result)."""
        self.memory = RankMemory.total([RankMemory.of(self.runner, own), *others])
        return own

    @abstractmethod
    def allocate(self, num_blocks: int) -> int: ...

    @abstractmethod
    def execute_model(self, batch: Any) -> Any: ...

    def submit_model(self, batch: Any) -> StepFuture:
        return DoneStep(self.execute_model(batch))

    def check_health(self) -> None:
        if self._failure is not None:
            raise self._failure

    def shutdown(self) -> None:
        return None
