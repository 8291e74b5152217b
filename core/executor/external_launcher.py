"""``external_launcher``: one rank per process, started by ``torchrun`` (vLLM's meaning).

Every rank runs the whole engine on the same prompts: the scheduler is deterministic, so each
rank schedules the same steps and runs its shard of each, and the collectives pair them up. The
world comes from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``). With pipeline stages, the last stage's first rank broadcasts
each step's output to every rank, so every rank samples the same tokens. Batches run one at a
time (``max_concurrent_batches`` stays 1): every rank runs its stage inside the engine's own step
and then joins the broadcast, so a second batch in flight would not overlap the stages, only
delay the first batch's broadcast until the last stage had computed the second. Process-0-only plugins
(IO processors, stat loggers) load in rank 0 alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from llmhal.executor.base import Executor, RankMemory


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(
            f"distributed_executor_backend='external_launcher' needs {name} in the environment: "
            "start one process per rank with torchrun (e.g. torchrun --nproc-per-node=2 app.py)"
        )
    return int(value)


class ExternalLauncherExecutor(Executor):
    def initialize(self, build_shard: Callable[[], Any]) -> None:
        from llmhal.distributed import init_distributed
        from llmhal.executor.worker import check_no_engine_here

        check_no_engine_here()
        par = self.config.parallel
        rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
        if world != par.world_size:
            raise ValueError(
                f"torchrun started {world} processes but tensor_parallel_size x "
                f"pipeline_parallel_size = {par.world_size}; they must be equal"
            )
        par.rank = rank
        init_distributed(
            world, rank, "env://", par.tensor_parallel_size, par.pipeline_parallel_size,
            local_rank=int(os.environ.get("LOCAL_RANK", rank)),
        )  # fmt: skip
        self._joined = True
        self.runner = build_shard()
        self._output_rank = (par.pipeline_parallel_size - 1) * par.tensor_parallel_size

    def determine_num_blocks(self) -> int:
        import torch

        from llmhal.distributed import get_world_group
        from llmhal.engine.builder import kv_blocks_fitting
        from llmhal.platforms import get_current_platform

        own = kv_blocks_fitting(self.config, self.runner, get_current_platform())
        # Every rank must agree (the schedulers run in lockstep): the fewest any rank holds.
        counts = get_world_group().all_gather(torch.tensor([own], dtype=torch.long), dim=0)
        return int(counts.min())

    def allocate(self, num_blocks: int) -> int:
        import torch

        from llmhal.distributed import get_world_group

        own = self.runner.allocate_kv_cache(num_blocks)
        mine = torch.tensor([RankMemory.of(self.runner, own)], dtype=torch.long)
        totals = get_world_group().all_gather(mine, dim=0).sum(0)
        self.memory = RankMemory(*(int(v) for v in totals))
        return own

    def execute_model(self, batch: Any) -> Any:
        runner = self.runner
        step, owners = runner.prepare(batch)
        out = runner.run(step)
        if self.config.parallel.pipeline_parallel_size > 1:
            from llmhal.distributed import get_world_group

            out = get_world_group().broadcast_object(out, src=self._output_rank)
        return runner.finish(owners, out)

    def shutdown(self) -> None:
        if self._joined:  # never another engine's group
            from llmhal.distributed import destroy_distributed

            destroy_distributed()
