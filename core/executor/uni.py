"""``uni``: the one rank runs in the engine's process; a step is a direct call to its runner."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmhal.executor.base import Executor


class UniProcExecutor(Executor):
    def initialize(self, build_shard: Callable[[], Any]) -> None:
        from llmhal.distributed import distributed_initialized

        if distributed_initialized():
            # Its layers would split themselves over the live engine's groups.
            raise RuntimeError(
                "this process is a rank of a multi-rank engine: a one-rank engine cannot be built "
                "beside it; call shutdown() on that LLM first"
            )
        self.runner = build_shard()

    def determine_num_blocks(self) -> int:
        from llmhal.engine.builder import kv_blocks_fitting
        from llmhal.platforms import get_current_platform

        return kv_blocks_fitting(self.config, self.runner, get_current_platform())

    def allocate(self, num_blocks: int) -> int:
        return self._record_memory(self.runner.allocate_kv_cache(num_blocks))

    def execute_model(self, batch: Any) -> Any:
        return self.runner.execute(batch)
