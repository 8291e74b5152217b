"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, each request's block list, and the
prefix cache (vLLM's automatic prefix caching).

With prefix caching on, every full block a request has computed is registered under a hash of
its tokens and of all the tokens before it (a chain: block i's hash covers block i - 1's). A
request that arrives (or is readmitted after preemption) with the same leading tokens takes those
blocks as they are, shared and reference-counted, and computes only the rest. A freed block keeps
its contents and registration until the pool hands it out again, least recently freed first, so a
common system prompt stays cached while it is in use.

Hashes are SHA-256, not Python's ``hash``: the tokens are chosen by clients, and a collision
would hand one request another's keys and values. An optional per-request salt (vLLM's
``cache_salt``) enters the first block's hash, so requests with different salts never share.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from llmhal.engine.request import Request
from llmhal.engine.stat_loggers import PrefixCacheStats

_ROOT = hashlib.sha256(b"llmhal prefix cache v1").digest()


def block_hash(parent: bytes | None, tokens: list[int], salt: str | None = None) -> bytes:
    """The hash of a full block of ``tokens`` after the block hashed ``parent`` (None: the first)."""
    h = hashlib.sha256(parent or _ROOT)
    if parent is None and salt is not None:
        h.update(b"salt:" + salt.encode())
    h.update(array("q", tokens).tobytes())
    return h.digest()


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Blocks without cached contents, as a stack, lowest block on top: the most recently freed
        # blocks are handed out first. The cache is allocated untouched, so a block's first write
        # faults its pages in; a FIFO pool cycled through every block of a multi-GiB cache,
        # faulting on every step (batch-32 decode attention 280 -> 130 us per layer) and growing
        # the process to the whole cache.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Freed blocks that still hold a registered prefix, least recently freed first: handed out
        # only when _free is empty, so a cached prefix outlives plain free blocks.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # registered block -> its hash
        self._cached: dict[bytes, int] = {}  # hash -> the block registered under it
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ allocation
    def allocate(
        self, request: Request, num_new_tokens: int, prefix: list[int] | None = None
    ) -> bool:
        """Grow ``request``'s blocks to hold ``num_new_tokens`` more tokens; False if the pool is
        short (and then nothing changed). ``prefix`` (from :meth:`cached_prefix`, for a request
        holding no blocks) are cached blocks it takes first: its first ``len(prefix)`` blocks of
        tokens count as computed."""
        prefix = prefix or []
        have = len(request.block_ids) + len(prefix)
        computed = request.num_computed_tokens + len(prefix) * self.block_size
        need = max(0, self.blocks_for(computed + num_new_tokens) - have)
        # A cached block nobody holds sits in the free pool: taking it as a hit uses it up too.
        taken = sum(1 for b in prefix if self._refs[b] == 0)
        if need + taken > self.num_free_blocks:
            return False
        for b in prefix:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1
        if prefix:
            request.block_ids.extend(prefix)
            request.num_computed_tokens = computed
            request.num_cached_blocks = len(prefix)
        for _ in range(need):
            b = self._free.pop() if self._free else self._evict()
            self._refs[b] = 1
            request.block_ids.append(b)
        return True

    def _evict(self) -> int:
        b, _ = self._evictable.popitem(last=False)
        del self._cached[self._hash_of.pop(b)]  # the two maps are each other's inverse
        return b

    def free(self, request: Request) -> None:
        # Tail blocks first: they are the least likely to be shared, so they are evicted first
        # (and, uncached, end lowest on the stack).
        for b in reversed(request.block_ids):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        request.block_ids = []
        request.num_cached_blocks = 0

    # ---------------------------------------------------------------- prefix cache
    def cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks that hold ``request``'s leading tokens (for :meth:`allocate`).

        The last token is always left to compute (its logits are sampled), and a request that
        asked for prompt log-probabilities reuses only the positions it already has them for."""
        if not self.enable_prefix_caching or request.block_ids:
            return []
        blocks: list[int] = []
        for i in range(self._hit_limit(request) // self.block_size):
            b = self._cached.get(self._hash(request, i))
            if b is None:
                break
            blocks.append(b)
        return blocks

    @staticmethod
    def _hit_limit(request: Request) -> int:
        """How many leading tokens ``request`` may take from the cache (see cached_prefix)."""
        limit = request.num_tokens - 1
        if request.pooling is not None and not request.pooling.pooling.reuses_prefix:
            return 0  # its pooler needs every position's hidden state, which the cache lacks
        if request.prompt_logprobs is not None:
            limit = min(limit, len(request.prompt_logprobs) - 1)
        return limit

    def pending_hashes(self, requests: list[Request]) -> set[bytes]:
        """The hashes of the blocks of known tokens that ``requests`` (running) will compute but
        have not registered yet."""
        if not self.enable_prefix_caching:
            return set()
        bs = self.block_size
        return {self._hash(r, i) for r in requests for i in range(r.num_cached_blocks, r.num_tokens // bs)}  # fmt: skip

    def worth_waiting(self, request: Request, num_prefix_blocks: int, pending: set[bytes]) -> bool:
        """Whether ``request`` should wait for blocks other running requests are computing now
        (they follow its cached prefix): admitted now, it would compute the same keys and values
        again; once they are registered, it takes them cached. Only when they are at least half
        of what it would compute, so a shared chat-template opening alone does not delay it."""
        bs = self.block_size
        limit = self._hit_limit(request)
        run = 0
        while (num_prefix_blocks + run + 1) * bs <= limit and self._hash(request, num_prefix_blocks + run) in pending:  # fmt: skip
            run += 1
        return run > 0 and 2 * run * bs >= request.num_tokens - num_prefix_blocks * bs

    def record_lookup(self, request: Request, hit_blocks: int) -> None:
        """Count a request's first admission (vLLM's prefix-cache queries and hits, in tokens).

        As in vLLM, a readmission after preemption is not counted (finding its own blocks again
        would inflate the hit rate under memory pressure), nor is a request that cannot read the
        cache (prompt log-probabilities for every position)."""
        if not self.enable_prefix_caching or request.num_cached_tokens is not None:
            return
        hits = hit_blocks * self.block_size
        request.num_cached_tokens = hits
        if request.prompt_logprobs is not None and len(request.prompt_logprobs) <= 1:
            return
        self.stats.requests += 1
        self.stats.queries += request.num_tokens
        self.stats.hits += hits

    def take_stats(self) -> PrefixCacheStats | None:
        """The lookups since the previous call (None with prefix caching off)."""
        if not self.enable_prefix_caching:
            return None
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats

    def cache_blocks(self, request: Request) -> None:
        """Register the request's blocks that are full and computed (after a step)."""
        if not self.enable_prefix_caching:
            return
        full = request.num_computed_tokens // self.block_size
        for i in range(request.num_cached_blocks, full):
            h = self._hash(request, i)
            b = request.block_ids[i]
            # Another request may have computed the same tokens in the same step: the first
            # registration stays, this copy is freed as a plain block.
            if h not in self._cached:
                self._cached[h] = b
                self._hash_of[b] = h
        request.num_cached_blocks = max(request.num_cached_blocks, full)

    def _hash(self, request: Request, i: int) -> bytes:
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) <= i:
            j = len(hashes)
            parent = hashes[j - 1] if j else None
            hashes.append(
                block_hash(parent, request.token_slice(j * bs, (j + 1) * bs), request.cache_salt)
            )
        return hashes[i]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after the weights changed). As in vLLM, only while no
        request holds a block (False then, and nothing changes): a running request would go on
        registering blocks whose keys were computed from the old ones."""
        if self.num_free_blocks != self.num_blocks:
            return False
        while self._evictable:
            self._free.append(self._evict())
        return True
