"""``ray``: ranks 1..N-1 as Ray actors; rank 0 is the engine's own process (the driver).

Imported only when this backend is chosen (Ray is heavy, and importing it has side effects). The
engine's process must reach a Ray cluster: the one ``ray.init()`` already connected to, or else
``ray.init()`` here (``RAY_ADDRESS`` names an existing cluster; without it Ray starts a local
one). Each actor runs a :class:`~llmhal.executor.worker.Worker` with this process's ``VLLM_*``,
``LLMHAL_*`` and ``PYTHONPATH`` variables, so it resolves the same platform and plugins. Each
step, rank 0 submits the step's inputs to every actor, runs its own shard, then collects the
actors' results: an actor that died or raised fails the engine with its rank and cause.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from llmhal.executor.base import EngineDeadError, Executor, RankMemory, StepFuture
from llmhal.logger import init_logger

logger = init_logger(__name__)

_PASSED_ENV_PREFIXES = ("VLLM_", "LLMHAL_", "OMP_")


def _passed_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith(_PASSED_ENV_PREFIXES)}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


class _RankActor:
    """The actor body: a Worker (see llmhal.executor.worker)."""

    def __init__(self, args: Any, parallel: Any, rank: int, init_method: str) -> None:
        from llmhal.executor.worker import Worker

        self.worker = Worker(args, parallel, rank, init_method)

    def load(self) -> int:
        return self.worker.load()

    def allocate(self, num_blocks: int) -> RankMemory:
        return self.worker.allocate(num_blocks)

    def execute(self, step: Any) -> Any:
        return self.worker.execute(step)

    def pid(self) -> int:
        return os.getpid()

    def busy(self) -> float:
        return self.worker.clock.busy_seconds


class RayExecutor(Executor):
    def initialize(self, build_shard: Callable[[], Any]) -> None:
        try:
            import ray
        except ImportError as e:
            raise ImportError(
                "distributed_executor_backend='ray' needs Ray: pip install ray"
            ) from e
        from llmhal.distributed.launch import free_port
        from llmhal.executor.worker import check_no_engine_here, join_process_group

        check_no_engine_here()  # before any actor starts
        self._ray = ray
        from llmhal.distributed.pipeline import StageClock

        self.clock = StageClock()  # rank 0's busy seconds (llmhal bench distributed)
        if not ray.is_initialized():
            ray.init()
        par = self.config.parallel
        host = ray.util.get_node_ip_address()
        init = f"tcp://{host}:{free_port()}"
        # num_cpus=0: a rank is placed by its need for the process, not for a CPU Ray counts
        # (on a small machine the actors would otherwise wait for CPUs the driver holds).
        actor_cls = ray.remote(num_cpus=0, runtime_env={"env_vars": _passed_env()})(_RankActor)
        self._actors = [
            actor_cls.options(name=None).remote(self.args, par, rank, init)
            for rank in range(1, par.world_size)
        ]
        loads = [a.load.remote() for a in self._actors]
        join_process_group(self.config, 0, init)
        self._joined = True
        self.runner = build_shard()
        self._blocks = self._get(loads)
        self._output_rank = (par.pipeline_parallel_size - 1) * par.tensor_parallel_size
        self.max_concurrent_batches = par.pipeline_parallel_size  # see MultiprocExecutor

    @property
    def worker_pids(self) -> list[int]:
        return self._get([a.pid.remote() for a in self._actors])

    def _get(self, refs: list[Any]) -> list[Any]:
        """The actors' results in rank order; EngineDeadError naming the first that failed."""
        ray = self._ray
        out = []
        for rank, ref in enumerate(refs, start=1):
            if ref is None:  # not waited for
                continue
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError as e:
                raise self._fail(rank, f"its Ray actor died ({type(e).__name__})") from None
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                raise self._fail(rank, f"raised {type(cause).__name__}: {cause}") from None
        return out

    def _fail(self, rank: int, cause: str) -> EngineDeadError:
        if self._failure is None:
            self._failure = EngineDeadError(rank, cause)
            logger.error("%s", self._failure)
            self._run_failure_callbacks()
        self._kill_actors()
        return self._failure

    def determine_num_blocks(self) -> int:
        from llmhal.engine.builder import kv_blocks_fitting
        from llmhal.platforms import get_current_platform

        own = kv_blocks_fitting(self.config, self.runner, get_current_platform())
        return min([own, *self._blocks])

    def allocate(self, num_blocks: int) -> int:
        refs = [a.allocate.remote(num_blocks) for a in self._actors]
        own = self.runner.allocate_kv_cache(num_blocks)
        return self._record_memory(own, self._get(refs))

    def execute_model(self, batch: Any) -> Any:
        return self.submit_model(batch).result()

    def submit_model(self, batch: Any) -> StepFuture:
        """Submit the step to every actor (an actor runs its calls in order) and run rank 0's
        own part; the actors' results are waited for by the future, so with pipeline stages
        rank 0 can start the next step's first stage meanwhile."""
        self.check_health()
        runner = self.runner
        step, owners = runner.prepare(batch)
        refs = [a.execute.remote(step) for a in self._actors]
        try:
            out = self.clock.run(runner.run, step)
        except Exception as e:
            # Name the actor behind a broken collective, if one failed (briefly: the others may
            # be blocked waiting for this rank).
            ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=5.0)
            self._get([r if r in ready else None for r in refs])
            raise self._fail(0, f"raised {type(e).__name__}: {e}") from e
        return _ActorStep(self, owners, refs, out)

    def _collect(self, owners: Any, refs: list[Any], out: Any) -> Any:
        self.check_health()
        outs = self._get(refs)
        if out is None:
            out = outs[self._output_rank - 1]
        return self.runner.finish(owners, out)

    def stage_busy_seconds(self) -> list[float]:
        """Each rank's seconds computing steps (see MultiprocExecutor.stage_busy_seconds)."""
        return [self.clock.busy_seconds, *self._get([a.busy.remote() for a in self._actors])]

    def _kill_actors(self) -> None:
        for a in getattr(self, "_actors", []):
            try:
                self._ray.kill(a)
            except Exception:  # already gone
                pass
        self._actors = []

    def shutdown(self) -> None:
        self._kill_actors()
        if self._joined:  # never another engine's group
            from llmhal.distributed import destroy_distributed

            destroy_distributed()


class _ActorStep(StepFuture):
    """A submitted step: the actors' pending results and rank 0's own output (None before the
    last pipeline stage)."""

    def __init__(self, executor: RayExecutor, owners: Any, refs: list[Any], out: Any) -> None:
        self._executor, self._owners, self._refs, self._out = executor, owners, refs, out

    def result(self) -> Any:
        return self._executor._collect(self._owners, self._refs, self._out)
