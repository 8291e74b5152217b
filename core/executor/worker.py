"""A rank's worker: its model shard and KV cache, in a process of its own (``mp``, ``ray``).

A worker is built from the engine's arguments, not from objects of the engine's process: it
resolves ``current_platform`` itself (so ``VLLM_PLATFORM`` and ``VLLM_PLUGINS`` in its
environment decide, and the platform plugin loads in this process), loads the general plugins
(vLLM's rule: every process), joins the process group, loads its shard of the weights and
sizes its share of the KV cache. IO-processor and stat-logger plugins are never loaded here:
they belong to process 0, which owns the requests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from llmhal.executor.base import RankMemory
from llmhal.logger import init_logger

logger = init_logger(__name__)


def check_no_engine_here() -> None:
    """RuntimeError if this process is already a rank of a live multi-rank engine: a process
    holds one process group."""
    from llmhal.distributed import distributed_initialized

    if distributed_initialized():
        raise RuntimeError(
            "this process is already a rank of a multi-rank engine (one per process): call "
            "shutdown() on that LLM first"
        )


def join_process_group(
    config: Any, rank: int, init_method: str, timeout_s: float | None = None
) -> None:
    """Join the world of ``config.parallel`` as ``rank`` (tp/pp groups built by llmhal.distributed;
    the platform's ``dist_backend``), giving up after ``timeout_s`` (None: torch's default)."""
    from llmhal.distributed import init_distributed

    check_no_engine_here()
    par = config.parallel
    init_distributed(
        par.world_size, rank, init_method, par.tensor_parallel_size, par.pipeline_parallel_size,
        join_timeout_s=timeout_s,
    )  # fmt: skip


class Worker:
    """Rank ``rank`` of ``parallel``; :meth:`load` builds it (in the process that will run it)."""

    def __init__(self, args: Any, parallel: Any, rank: int, init_method: str) -> None:
        # The speculative proposer and the progress line live in process 0 only.
        self.args = dataclasses.replace(args, speculative_config=None, load_progress=False)
        self.parallel = dataclasses.replace(parallel, rank=rank)
        self.rank = rank
        self.init_method = init_method
        self.runner: Any = None
        self.platform: Any = None
        from llmhal.distributed.pipeline import StageClock

        self.clock = StageClock()  # its stage's busy seconds (llmhal bench distributed)

    def load(self, before_join: Callable[[], None] | None = None) -> int:
        """Resolve the platform, load general plugins, join the group, load this rank's shard;
        returns the KV-cache blocks this rank's budget holds. ``before_join`` runs just before
        joining (the executor learns that this rank got past imports and config)."""
        from llmhal.default_model import default_model_path
        from llmhal.engine.builder import kv_blocks_fitting, load_model, resolve_engine_config
        from llmhal.model_loader.source import resolve_source
        from llmhal.platforms import get_current_platform
        from llmhal.plugins import load_general_plugins

        load_general_plugins()
        self.platform = platform = get_current_platform()
        source = resolve_source(self.args.model or default_model_path())
        config, ckpt, model_cls = resolve_engine_config(self.args, platform, source)
        config.parallel = self.parallel
        if before_join is not None:
            before_join()
        join_process_group(config, self.rank, self.init_method)
        platform.seed(config.model.seed)
        self.runner = load_model(config, ckpt, model_cls)
        return kv_blocks_fitting(config, self.runner, platform)

    def allocate(self, num_blocks: int) -> RankMemory:
        """This rank's KV cache; returns what the rank holds (its KV and weight bytes)."""
        return RankMemory.of(self.runner, self.runner.allocate_kv_cache(num_blocks))

    def execute(self, step: Any) -> Any:
        """Run one step's inputs (a ModelRunner StepInput); the StepOutput where this rank has
        one (the last pipeline stage), else None."""
        with self.platform.inference_mode():
            return self.clock.run(self.runner.run, step)

    def close(self) -> None:
        from llmhal.distributed import destroy_distributed

        destroy_distributed()
