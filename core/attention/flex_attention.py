"""``flex_attention``: torch's flex attention over the paged KV cache, through a block mask.

The whole step is one flattened query sequence (all requests' new tokens) attending to the whole
cache viewed as one key sequence of ``num_blocks * block_size`` slots. What a query may see is
decided by

* a **mask_mod** (the exact rule): the key slot's physical block belongs to the query's request
  (the block table is inverted once per step into "owner request, first position" per physical
  block), the key's position is at or before the query's, and inside the sliding window if any;
* a **block mask** built directly from the block table (the speed): for each tile of ``Q_TILE``
  query tokens, the physical blocks its requests need, so the fused kernel skips every other block
  unread. It is a superset of what the mask_mod admits.

A soft-cap is a score_mod. Cache layout (owned by this backend): ``[2, num_kv_heads, num_blocks,
block_size, head_size]``, so each head's keys are one contiguous ``[slots, head_size]`` matrix and
the kernel reads the cache in place (no gather, no copy).

Compilation (``LLMHAL_FLEX_COMPILE``: ``auto`` (default), ``1``, ``0``). ``auto`` compiles with the
platform's ``simple_compile_backend`` when ``platform.capabilities.torch_compile`` says it works,
and runs eagerly otherwise; ``1`` insists (a warning if the platform says no), ``0`` is eager.
Measured on the shared 2-core development CPU (9/3 heads, head size 64, 4096-block cache; noisy):
eager flex costs 0.1-0.9 s *per call* (the mask closure is traced again every step, and scores are
dense), so it is a correctness fallback; compiled, the first call of a shape costs 3-18 s with a
cold inductor cache, later calls 5-25 ms for 8 decodes of 512 tokens and 80-190 ms for a
512-token prefill or 32 decodes of 1024 tokens, 3-15x faster than eager. Hence ``auto``.
Query counts are padded to powers of two (at least 16) and the key range is always the whole
cache, so only one shape per power of two compiles (``dynamic=True`` hits an inductor C++ codegen
bug for this mask on CPU in torch 2.13). Eager mode instead gathers the blocks the step uses into a
compact key range (its dense scores then grow with the step's context, not with the cache) and
chunks the queries so they stay under :data:`EAGER_SCORE_BUDGET` elements.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from llmhal.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerState,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from llmhal.attention.paged_kv import quantize_to_cache, written_slots
from llmhal.attention.utils import check_step
from llmhal.logger import init_logger

logger = init_logger(__name__)

Q_TILE = 128  # query tokens per block-mask row
EAGER_SCORE_BUDGET = 64 << 20  # score elements per eager chunk (x4 bytes, plus temporaries)


def _padded(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


@dataclass
class FlexMetadata:
    """One step, for every flex layer: who each query token and each physical block belongs to.

    Block masks depend on the layer's sliding window and on the cache's block count, so they are
    built on first use and shared by the layers that agree on both.
    """

    num_actual_tokens: int
    padded_tokens: int  # query rows after padding to a compile bucket
    block_size: int
    q_req: torch.Tensor  # int32 [padded_tokens]: request of each query token, -2 for padding
    q_pos: torch.Tensor  # int64 [padded_tokens]
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens]
    block_req: torch.Tensor  # int32 [max_block + 1]: owning request, -1 = none this step
    block_pos0: torch.Tensor  # int64 [max_block + 1]: position of the block's first slot
    table: torch.Tensor  # int64 [num_reqs, width]
    valid: torch.Tensor  # bool [num_reqs, width]: the columns that hold a block of the request
    max_block: int
    used_blocks: torch.Tensor  # int64, ascending: the physical blocks the step's requests own
    _cache: dict[Any, Any] = field(default_factory=dict)

    def compact(self) -> FlexMetadata:
        """The same step over a key range of only the used blocks, in ``used_blocks`` order
        (block ``i`` of the compact range is physical block ``used_blocks[i]``)."""
        if "compact" not in self._cache:
            n_used = self.used_blocks.shape[0]
            remap = torch.zeros(self.max_block + 1, dtype=torch.int64, device=self.table.device)
            remap[self.used_blocks] = torch.arange(n_used, device=self.table.device)
            self._cache["compact"] = replace(
                self,
                block_req=self.block_req[self.used_blocks],
                block_pos0=self.block_pos0[self.used_blocks],
                table=remap[self.table.clamp(0, self.max_block)],
                max_block=n_used - 1,
                used_blocks=torch.arange(n_used, device=self.table.device),
                _cache={},
            )
        return self._cache["compact"]

    def block_owners(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``block_req``/``block_pos0`` covering ``num_blocks`` physical blocks."""
        key = ("owners", num_blocks)
        if key not in self._cache:
            pad = num_blocks - self.block_req.shape[0]
            self._cache[key] = (
                F.pad(self.block_req, (0, pad), value=-1),
                F.pad(self.block_pos0, (0, pad)),
            )
        return self._cache[key]

    def kv_rows(self, window: int | None, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For each tile of Q_TILE query tokens, the physical blocks its requests need: the first
        ``kv_num_blocks[t]`` entries of ``kv_indices[t]``, ascending. A superset of what the
        mask admits (whole logical blocks between each token's window start and its position)."""
        key = ("rows", window, num_blocks)
        if key in self._cache:
            return self._cache[key]
        bs, total = self.block_size, self.num_actual_tokens
        dev = self.table.device
        n = self.table.shape[0]
        tiles = -(-self.padded_tokens // Q_TILE)
        pos = self.q_pos[:total]
        hi = pos // bs
        lo = (pos - window + 1).clamp(min=0) // bs if window else torch.zeros_like(hi)
        pair = self.q_req[:total].long() * tiles + torch.arange(total, device=dev) // Q_TILE
        pair_lo = torch.full((n * tiles,), 1 << 40, dtype=torch.int64, device=dev)
        pair_hi = torch.full((n * tiles,), -1, dtype=torch.int64, device=dev)
        pair_lo.scatter_reduce_(0, pair, lo, "amin")
        pair_hi.scatter_reduce_(0, pair, hi, "amax")
        col = torch.arange(self.table.shape[1], device=dev)
        # need[r, t, j]: logical block j of request r is needed by query tile t
        need = (col >= pair_lo.view(n, tiles, 1)) & (col <= pair_hi.view(n, tiles, 1))
        need &= self.valid[:, None, :]
        dense = torch.zeros(tiles, num_blocks, dtype=torch.bool, device=dev)
        r_idx, t_idx, j_idx = need.nonzero(as_tuple=True)
        dense[t_idx, self.table[r_idx, j_idx]] = True
        kv_num = dense.sum(-1, dtype=torch.int32).view(1, 1, tiles)
        order = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        self._cache[key] = (kv_num, order.view(1, 1, tiles, num_blocks))
        return self._cache[key]

    def block_mask(self, window: int | None, num_blocks: int, rows: tuple[int, int]) -> Any:
        """The BlockMask of query rows ``rows`` (tile-aligned) against ``num_blocks`` blocks."""
        key = ("mask", window, num_blocks, rows)
        if key in self._cache:
            return self._cache[key]
        from torch.nn.attention.flex_attention import BlockMask

        bs = self.block_size
        start, end = rows
        q_req, q_pos = self.q_req[start:end], self.q_pos[start:end]
        block_req, block_pos0 = self.block_owners(num_blocks)

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            blk = kv_idx // bs
            k_pos = block_pos0[blk] + kv_idx % bs
            ok = (block_req[blk] == q_req[q_idx]) & (k_pos <= q_pos[q_idx])
            if window:
                ok = ok & (k_pos > q_pos[q_idx] - window)
            return ok

        kv_num, kv_idx = self.kv_rows(window, num_blocks)
        t0, t1 = start // Q_TILE, -(-end // Q_TILE)
        mask = BlockMask.from_kv_blocks(
            kv_num[..., t0:t1].contiguous(),
            kv_idx[..., t0:t1, :].contiguous(),
            BLOCK_SIZE=(Q_TILE, bs),
            mask_mod=mask_mod,
            seq_lengths=(end - start, num_blocks * bs),
            compute_q_blocks=False,
        )
        self._cache[key] = mask
        return mask


class FlexMetadataBuilder(AttentionMetadataBuilder[FlexMetadata]):
    def build(self, common: CommonAttentionMetadata) -> FlexMetadata:
        check_step(common, FlexAttentionBackend.name)
        bs = self.requirements.block_size
        dev = common.block_table.device
        n, total = common.num_reqs, common.num_actual_tokens
        padded = _padded(total)
        q_req = torch.full((padded,), -2, dtype=torch.int32)
        q_req[:total] = torch.repeat_interleave(
            torch.arange(n, dtype=torch.int32), common.query_lens_cpu().long()
        )
        q_pos = torch.zeros(padded, dtype=torch.int64, device=dev)
        q_pos[:total] = common.positions[:total]

        table = common.block_table.long()
        width = table.shape[1]
        col = torch.arange(width, device=dev)
        valid = col[None, :] < (common.seq_lens.long()[:, None] + bs - 1) // bs
        used = table[valid]
        max_block = int(used.max()) if used.numel() else 0
        owners = torch.bincount(used, minlength=max_block + 1)
        if bool((owners > 1).any()):
            shared = torch.nonzero(owners > 1).flatten().tolist()[:8]
            raise ValueError(
                "flex_attention needs every KV block to belong to one request in a step; "
                f"blocks {shared} appear in several block-table rows"
            )
        block_req = torch.full((max_block + 1,), -1, dtype=torch.int32, device=dev)
        block_req[used] = torch.arange(n, dtype=torch.int32, device=dev)[:, None].expand(n, width)[
            valid
        ]
        block_pos0 = torch.zeros(max_block + 1, dtype=torch.int64, device=dev)
        block_pos0[used] = col.expand(n, width)[valid] * bs
        return FlexMetadata(
            num_actual_tokens=total,
            padded_tokens=padded,
            block_size=bs,
            q_req=q_req.to(dev),
            q_pos=q_pos,
            slot_mapping=common.slot_mapping[:total],
            block_req=block_req,
            block_pos0=block_pos0,
            table=table,
            valid=valid,
            max_block=max_block,
            used_blocks=torch.unique(used),
        )


# ------------------------------------------------------------------------- compile decisions
@functools.cache
def _compiled_flex(backend: str) -> Any:
    import torch._dynamo.config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    # One compiled variant per (query bucket, dtype, head shape, window/soft-cap): more than
    # dynamo's default of 8 per function, after which it would silently fall back to eager.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    return torch.compile(flex_attention, backend=backend, dynamic=False, fullgraph=True)


def _compile_mode() -> str:
    mode = os.environ.get("LLMHAL_FLEX_COMPILE", "auto").strip().lower() or "auto"
    if mode not in ("0", "1", "auto"):
        raise ValueError(
            f"LLMHAL_FLEX_COMPILE={mode!r} is not valid: use auto (compile where the platform "
            "supports torch.compile), 1 (always compile) or 0 (eager)"
        )
    return mode


def compile_backend() -> str | None:
    """The torch.compile backend flex attention uses now, or None for eager (module docstring)."""
    mode = _compile_mode()
    if mode == "0":
        return None
    from llmhal.platforms import get_current_platform

    platform = get_current_platform()
    if platform.capabilities.torch_compile:
        return platform.simple_compile_backend
    if mode == "1":
        logger.warning(
            "LLMHAL_FLEX_COMPILE=1 but the %s platform reports that torch.compile does not work "
            "there; running flex_attention eagerly",
            platform.name,
        )
    return None


@functools.cache
def _warn_eager_once(head_size: int, block_size: int) -> None:
    logger.warning(
        "flex_attention runs eagerly (slower) for head size %d with block size %d: torch's "
        "compiled CPU kernel gives wrong results for that shape; a block size that is a multiple "
        "of 16 keeps it compiled",
        head_size,
        block_size,
    )


def compiled_cpu_flex_is_wrong(head_size: int, block_size: int) -> bool:
    """Whether torch's compiled CPU flex_attention gives wrong results for this shape, so the
    eager kernel must run instead. Measured on torch 2.13 (one query over keys spanning two cache
    blocks, against a plain softmax): head sizes 8 and 16 with cache blocks of 8, 24, 40 or 56
    slots are off by 0.4-0.8 (eager: 1e-7); block sizes 2, 4, 12, 16, 20 and 48, and head sizes
    32, 64 and 128 with any of them, are right. Real models' heads are >= 64; tiny test models
    hit it."""
    return head_size < 32 and block_size % 16 == 8


# --------------------------------------------------------------------------------- the layer
class FlexAttentionImpl(AttentionImpl[FlexMetadata]):
    def forward(
        self,
        layer: AttentionLayerState,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlexMetadata,
    ) -> torch.Tensor:
        m = attn_metadata
        total = m.num_actual_tokens
        _write_kv(kv_cache, key[:total], value[:total], m.slot_mapping[:total], layer)
        out = torch.zeros_like(query)
        if total == 0:
            return out
        q = query.new_zeros(m.padded_tokens, self.num_heads, self.head_size)
        q[:total] = query[:total]
        q = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        backend = compile_backend()
        heads, size = self.num_kv_heads, self.head_size
        if (
            backend is not None
            and q.device.type == "cpu"
            and compiled_cpu_flex_is_wrong(size, m.block_size)
        ):
            _warn_eager_once(size, m.block_size)
            backend = None
        if backend is not None:
            # The whole cache in place ([Hkv, blocks, block_size, D] viewed as [1, Hkv, slots, D]),
            # so the compiled shape depends only on the padded token count.
            k = kv_cache[0].view(1, heads, -1, size)
            v = kv_cache[1].view(1, heads, -1, size)
            res = self._attend(q, k, v, m, (0, m.padded_tokens), backend)
        else:
            # Eager scores are dense over the key range: gather the step's blocks only, and chunk
            # the queries so the scores stay under EAGER_SCORE_BUDGET elements.
            c = m.compact()
            k = kv_cache[0][:, m.used_blocks].view(1, heads, -1, size)
            v = kv_cache[1][:, m.used_blocks].view(1, heads, -1, size)
            step = EAGER_SCORE_BUDGET // max(1, k.shape[2] * self.num_heads)
            step = max(Q_TILE, step // Q_TILE * Q_TILE)
            rows = q.shape[2]
            parts = [
                self._attend(q[:, :, s : s + step], k, v, c, (s, min(s + step, rows)), None)
                for s in range(0, rows, step)
            ]
            res = torch.cat(parts, dim=2)
        out[:total] = res[0].transpose(0, 1)[:total]
        return out

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        m: FlexMetadata,
        rows: tuple[int, int],
        backend: str | None,
    ) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        mask = m.block_mask(self.sliding_window, k.shape[2] // m.block_size, rows)
        score_mod = None
        cap = self.logits_soft_cap
        if cap:

            def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return cap * torch.tanh(score / cap)

        # GPU kernels need the block mask's KV block (the cache block) to be a multiple of their
        # BLOCK_N tile (64 by default); small cache blocks get a matching tile. The CPU kernel
        # takes any block size (compiled, not every one with small heads: see forward()).
        options = None
        if q.device.type != "cpu" and m.block_size < 64:
            options = {"BLOCK_N": m.block_size}
        fn = _compiled_flex(backend) if backend is not None else flex_attention
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*without torch.compile")
            return fn(
                q,
                k,
                v,
                score_mod=score_mod,
                block_mask=mask,
                scale=self.scale,
                enable_gqa=True,
                kernel_options=options,
            )


def _write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer: AttentionLayerState,
) -> None:
    """Store the step's keys/values in this backend's head-major layout (-1 slots are skipped)."""
    slots, index = written_slots(slot_mapping)
    if index is not None:
        key, value = key[index], value[index]
    kv_heads, head_size = kv_cache.shape[1], kv_cache.shape[-1]
    kc = kv_cache[0].view(kv_heads, -1, head_size)
    vc = kv_cache[1].view(kv_heads, -1, head_size)
    kc[:, slots] = quantize_to_cache(key, kv_cache.dtype, layer.k_scale).transpose(0, 1)
    vc[:, slots] = quantize_to_cache(value, kv_cache.dtype, layer.v_scale).transpose(0, 1)


class FlexAttentionBackend(AttentionBackend):
    """Paged attention through ``torch.nn.attention.flex_attention`` (see the module docstring)."""

    name = "flex_attention"
    kind = "mha"
    supported_dtypes = ("float32", "bfloat16", "float16")
    supported_kv_cache_dtypes = ("auto",)
    supports_sliding_window = True
    supports_logits_soft_cap = True

    @staticmethod
    def get_impl_cls() -> type[FlexAttentionImpl]:
        return FlexAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FlexMetadataBuilder]:
        return FlexMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: str = "auto",
    ) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_size)
