"""The state cache of recurrent layers, beside the paged KV cache.

Every running request holds one *slot*: the same index into every recurrent layer's state tensors
(:attr:`llmhal.attention.state.RecurrentLayer.states`). :class:`StateCacheManager` hands slots out
together with KV blocks, so the scheduler needs no change: admission fails (the request waits)
when no slot is free, exactly as when blocks are short, and freeing a request (finished, aborted,
preempted) releases its slot with its blocks. A preempted request is recomputed from its first
token, so its next slot starts from a zero state and no state is ever copied or rolled back: a
prefill ignores what the slot holds (``has_initial_state`` False), and the runner zeroes the slot of
a request whose first step is a single token (it runs as a decode, and decode kernels continue the
state they find), on every rank of a parallel engine.

:func:`plan_caches` splits one memory budget between KV blocks and state slots. A model with only
recurrent layers needs no KV memory: its block pool is bookkeeping only (the runner builds block
tables that no layer reads), sized so that blocks never limit it.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmhal.engine.kv_cache_manager import KVCacheManager
from llmhal.engine.request import Request


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int
    num_slots: int
    # Why the numbers are what they are, for the log and the load report.
    note: str


def plan_caches(
    budget: int,
    bytes_per_block: int,
    bytes_per_slot: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
) -> CachePlan:
    """Blocks and slots from ``budget`` bytes.

    * attention only: every byte goes to blocks (as before this module existed; 0 blocks when the
      budget is below one, which the caller reports);
    * recurrent only: ``min(max_num_seqs, budget // bytes_per_slot)`` slots, and a bookkeeping block
      pool large enough for each of them to reach ``max_model_len``;
    * hybrid: states take at most half the budget (at least one slot), blocks the rest, so both
      caches admit a useful number of requests and the scheduler stops at whichever runs out.
    """
    blocks_per_seq = -(-max_model_len // block_size)
    if bytes_per_slot == 0:
        if bytes_per_block == 0:
            raise ValueError("the model has neither attention nor recurrent layers")
        n = budget // bytes_per_block  # the caller names a budget below one block
        return CachePlan(int(n), 0, f"{n} KV blocks")
    share = budget if bytes_per_block == 0 else budget // 2
    slots = min(max_num_seqs, share // bytes_per_slot)
    if slots < 1:
        raise ValueError(
            f"The cache budget ({budget} bytes) cannot hold the recurrent state of one sequence "
            f"({bytes_per_slot} bytes{'' if bytes_per_block == 0 else ' in half the budget'}); "
            "raise kv_cache_memory_bytes."
        )
    if bytes_per_block == 0:
        return CachePlan(
            int(slots * blocks_per_seq),
            int(slots),
            f"{slots} state slots of {bytes_per_slot} bytes (no KV cache: no attention layers)",
        )
    blocks = (budget - slots * bytes_per_slot) // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"The cache budget ({budget} bytes) leaves no KV block ({bytes_per_block} bytes) beside "
            f"{slots} state slots; raise kv_cache_memory_bytes."
        )
    return CachePlan(
        int(blocks),
        int(slots),
        f"{slots} state slots of {bytes_per_slot} bytes, {blocks} KV blocks",
    )


class StateCacheManager(KVCacheManager):
    """KV blocks plus one state slot per request (see the module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        enable_prefix_caching: bool = False,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"the state cache needs at least one slot, got {num_slots}")
        if enable_prefix_caching:
            # A cached block holds keys and values, not the recurrent state after it.
            raise ValueError("prefix caching cannot serve recurrent layers; turn it off")
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        self.num_slots = num_slots
        # Lowest slot handed out first (a stack, like the block pool): few slots stay warm.
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[Request, int] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def slot_of(self, request: Request) -> int:
        try:
            return self._slot_of[request]
        except KeyError:
            raise RuntimeError(
                f"request {request.request_id} holds no state slot (it was not admitted)"
            ) from None

    def allocate(
        self, request: Request, num_new_tokens: int, prefix: list[int] | None = None
    ) -> bool:
        """Blocks as :meth:`KVCacheManager.allocate`, and a slot for a request that has none;
        False (and nothing taken) when either is short."""
        taken = request not in self._slot_of
        if taken:
            if not self._free_slots:
                return False
            self._slot_of[request] = self._free_slots.pop()
        if super().allocate(request, num_new_tokens, prefix):
            return True
        if taken:
            self._free_slots.append(self._slot_of.pop(request))
        return False

    def free(self, request: Request) -> None:
        super().free(request)
        slot = self._slot_of.pop(request, None)
        if slot is not None:
            self._free_slots.append(slot)


def make_cache_manager(
    num_blocks: int,
    block_size: int,
    num_slots: int,
    enable_prefix_caching: bool,
) -> KVCacheManager:
    """The engine's cache manager: KV blocks only, or blocks and state slots."""
    if num_slots:
        return StateCacheManager(num_blocks, block_size, num_slots)
    return KVCacheManager(num_blocks, block_size, enable_prefix_caching)
