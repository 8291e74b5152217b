"""Paged KV-cache bookkeeping: a pool of fixed-size blocks and each request's block list."""

from __future__ import annotations

from llmhal.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack, lowest block on top: the most recently freed blocks are handed out first. The
        # cache is allocated untouched, so a block's first write faults its pages in; a FIFO pool
        # cycled through every block of a multi-GiB cache, faulting on every step (batch-32
        # decode attention 280 -> 130 us per layer) and growing the process to the whole cache.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Grow ``request``'s blocks to hold ``num_new_tokens`` more tokens; False if the pool is short."""
        need = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(
            request.block_ids
        )
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        request.block_ids.extend(self._free.pop() for _ in range(need))
        return True

    def free(self, request: Request) -> None:
        self._free.extend(reversed(request.block_ids))
        request.block_ids = []
