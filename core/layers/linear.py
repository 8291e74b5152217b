"""Quantization-aware linear layers, replicated or split across the tensor-parallel group.

A layer may merge several projections (q/k/v, gate/up) into one matmul. Each layer asks the
engine's quantization config for its method (by prefix); unquantized layers use
``UnquantizedLinearMethod``.

Tensor parallelism (Megatron's split, as vLLM does it): a column-parallel layer holds a slice of
every projection's outputs (each rank computes its slice, no communication); a row-parallel layer
holds a slice of the inputs and sums the ranks' partial products with one all-reduce. A block
column -> row (q/k/v -> o, gate/up -> down) therefore costs one all-reduce of the hidden state.

The quantization method creates the rank's parameters at the rank's sizes; the layer then wraps
every parameter's ``weight_loader`` so that a checkpoint tensor is cut to the rank's slice before
it is copied (:func:`_rank_slice`). The cut follows the loading protocol's attributes
(``output_dim``/``input_dim``, see :mod:`llmhal.layers.weights`) and is proportional: a stored
entry stands for ``weights / entries`` weights, which is exact for plain rows, packed words,
per-group scales and ggml blocks alike (a parameter's ``shard_unit`` attribute: stored entries
that must stay together, e.g. one ggml block's bytes) provided the rank's range begins and ends on
their boundaries. A split that would cut a quantization group, a packed word or a block is an
error naming the layer and the remedy. An extent of 1 (a per-tensor scale) is replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import torch
from torch import nn

from llmhal.layers.weights import WeightLoadError, sharded_weight_loader
from llmhal.quantization.base import QuantizationConfig, QuantizeMethodBase
from llmhal.quantization.unquantized import UnquantizedLinearMethod

# shard id -> (first unit, number of units, units in all): the checkpoint tensor is cut into
# equal units (a rank's share, or one attention head) and the rank holds a run of them.
SplitFn = Callable[[Any], tuple[int, int, int]]


def _current_quant_and_dtype() -> tuple[QuantizationConfig | None, torch.dtype]:
    from llmhal.config import get_current_config

    cfg = get_current_config()
    return cfg.quant_config, cfg.model.dtype


def quant_and_dtype(
    quant_config: QuantizationConfig | None, params_dtype: torch.dtype | None
) -> tuple[QuantizationConfig | None, torch.dtype]:
    """The layer's quantization config and parameter dtype: the given ones, else the engine's."""
    if quant_config is None or params_dtype is None:
        q, dt = _current_quant_and_dtype()
        quant_config = quant_config if quant_config is not None else q
        params_dtype = params_dtype or dt
    return quant_config, params_dtype


def tp_rank_and_size() -> tuple[int, int]:
    """This process's tensor-parallel rank and group size ((0, 1) when not distributed)."""
    from llmhal.distributed.parallel_state import get_tp_group

    g = get_tp_group()
    return g.rank_in_group, g.world_size


def divide(total: int, parts: int, what: str) -> int:
    """``total / parts``, or an error naming ``what`` must divide evenly (a tensor split)."""
    if total % parts:
        raise ValueError(
            f"{what} ({total}) does not split into {parts} equal parts; use a "
            f"tensor_parallel_size that divides it"
        )
    return total // parts


def _rank_slice(
    layer: nn.Module, name: str, dim_attr: str, split: SplitFn, *, pad: bool = False
) -> Callable[..., None]:
    """Wrap ``layer``'s parameter ``name``'s loader: cut the checkpoint tensor to this rank's part
    along the parameter's ``dim_attr`` dimension first. ``pad``: the last part may be short
    (a vocabulary not divisible by the ranks) and is zero-padded to the others' size."""
    param = getattr(layer, name)
    inner = param.weight_loader

    def load(p: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        dim = getattr(p, dim_attr, None)
        first, count, total = split(shard_id)
        if total > 1 and dim is not None and loaded.dim() > dim and loaded.shape[dim] != 1:
            extent = loaded.shape[dim]
            if pad:
                unit = -(-extent // total)
                start, per = min(first * unit, extent), count * unit
            else:
                start, per = _stored_range(
                    layer, name, p, dim_attr, shard_id, extent, first, count, total
                )
            loaded = loaded.narrow(dim, start, min(per, extent - start))
            if loaded.shape[dim] < per:
                shape = list(loaded.shape)
                shape[dim] = per - loaded.shape[dim]
                loaded = torch.cat([loaded, loaded.new_zeros(shape)], dim=dim)
        inner(p, loaded, shard_id)

    return load


def _stored_range(
    layer: nn.Module,
    name: str,
    p: torch.Tensor,
    dim_attr: str,
    shard_id: Any,
    extent: int,
    first: int,
    count: int,
    total: int,
) -> tuple[int, int]:
    """(start, length) in stored entries of this rank's units ``first .. first+count-1`` of
    ``total`` along a dimension stored as ``extent`` entries. A stored entry stands for
    ``weights / extent`` weights (a packed word, a group's scale, a block's scale), or
    ``shard_unit`` entries make one indivisible block (a ggml block's bytes); the rank's range
    must begin and end on those boundaries, else a group or block would be cut: an error."""
    if dim_attr == "input_dim":
        mine = layer.input_size
    else:
        ids = list(getattr(layer, "shard_names", [0]))
        mine = layer.output_sizes[ids.index(shard_id) if shard_id in ids else 0]
    per_unit = mine // count
    weights = per_unit * total
    unit = getattr(p, "shard_unit", None) if dim_attr == "input_dim" else None
    block_e = unit or 1
    blocks = extent // block_e
    # (a ragged last block, weights % blocks != 0: where the rank's range falls in it is unknown)
    ok = extent % block_e == 0 and blocks > 0 and weights % blocks == 0
    block_w = weights // blocks if ok else 1
    start_w, end_w = first * per_unit, (first + count) * per_unit
    if not ok or start_w % block_w or end_w % block_w:
        raise WeightLoadError(
            f"{getattr(layer, 'prefix', '') or type(layer).__name__}.{name}: this rank's "
            f"{'inputs' if dim_attr == 'input_dim' else 'outputs'} {start_w}..{end_w} of {weights}, "
            f"stored as {extent} entries, do not fall on the boundaries of its quantization "
            f"groups, packed words or blocks; use a tensor_parallel_size whose parts hold whole "
            f"groups (or tensor_parallel_size=1)"
        )
    return start_w // block_w * block_e, (end_w - start_w) // block_w * block_e


def shard_parameters(layer: nn.Module, dim_attr: str, split: SplitFn, *, pad: bool = False) -> None:
    """Make every parameter of ``layer`` (its own, not its children's) load its rank's part."""
    for name, p in list(layer.named_parameters(recurse=False)):
        if hasattr(p, "weight_loader"):
            p.weight_loader = _rank_slice(layer, name, dim_attr, split, pad=pad)


def check_tp_shardable(layer: nn.Module, tp_size: int) -> None:
    """Refuse a split layer whose quantization method does not declare ``tp_shardable``: its
    checkpoint tensors (e.g. flattened 4-bit blocks, shape records) are not cut by the loading
    protocol's attributes, and copying them whole would fail or, worse, compute garbage."""
    method = layer.quant_method
    if tp_size > 1 and not getattr(method, "tp_shardable", False):
        raise ValueError(
            f"{getattr(layer, 'prefix', '') or type(layer).__name__}: the quantization method "
            f"{type(method).__name__} does not split across tensor-parallel ranks; use "
            f"tensor_parallel_size=1 (pipeline_parallel_size may still split the model), or a "
            f"checkpoint in a format that does (unquantized, GPTQ, AWQ, fp8, GGUF)"
        )


class LinearBase(nn.Module):
    """``y = x @ W.T + b`` where ``W`` stacks ``output_sizes`` shards named ``shard_names``.

    ``input_size`` and ``output_sizes`` are this rank's (a parallel subclass divides the model's
    sizes before calling this)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        bias: bool = False,
        shard_names: Sequence[Any] | None = None,
        quant_config: QuantizationConfig | None = None,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        quant_config, params_dtype = quant_and_dtype(quant_config, params_dtype)
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(self.output_sizes)
        self.shard_names = (
            list(shard_names) if shard_names is not None else list(range(len(self.output_sizes)))
        )
        self.prefix = prefix
        self.params_dtype = params_dtype
        offsets = [0, *accumulate(self.output_sizes)][:-1]
        loader = sharded_weight_loader(offsets, self.output_sizes, self.shard_names)
        method: QuantizeMethodBase | None = None
        if quant_config is not None:
            method = quant_config.get_quant_method(self, prefix)
        self.quant_method: QuantizeMethodBase = method or UnquantizedLinearMethod()
        check_tp_shardable(self, getattr(self, "tp_size", 1))
        try:
            self.quant_method.create_weights(
                self, input_size, self.output_sizes, params_dtype, weight_loader=loader
            )
        except ValueError as e:
            tp = getattr(self, "tp_size", 1)
            if tp == 1:
                raise
            raise ValueError(
                f"{e} (sizes of tensor-parallel rank {self.tp_rank}'s part, 1/{tp} of the "
                f"layer: use a tensor_parallel_size whose parts hold whole quantization groups "
                f"and blocks, or tensor_parallel_size=1)"
            ) from None
        if bias:
            b = nn.Parameter(torch.zeros(self.output_size, dtype=params_dtype), requires_grad=False)
            b.output_dim = 0
            b.weight_loader = loader
            self.register_parameter("bias", b)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, method={type(self.quant_method).__name__}"


class ReplicatedLinear(LinearBase):
    """A plain linear layer (one shard), the whole weight on every rank."""

    def __init__(self, input_size: int, output_size: int, **kw: Any) -> None:
        super().__init__(input_size, [output_size], **kw)


class MergedLinear(LinearBase):
    """Several projections of the same input in one matmul, shards 0..n-1 (e.g. gate and up),
    replicated."""


class QKVLinear(LinearBase):
    """The q, k and v projections in one matmul; shards "q", "k", "v"; replicated."""

    def __init__(
        self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, **kw: Any
    ) -> None:
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        sizes = [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size]
        super().__init__(hidden_size, sizes, shard_names=["q", "k", "v"], **kw)


class MergedColumnParallelLinear(MergedLinear):
    """Projections of the same input, each split along its outputs across the tensor-parallel
    ranks: rank ``r`` holds part ``r`` of every shard (of gate and of up), so its output is the
    rank's slice of each projection, side by side. ``gather_output``: all-gather the full output
    (otherwise the rank's slice is returned, for a row-parallel layer to consume)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        gather_output: bool = False,
        prefix: str = "",
        **kw: Any,
    ) -> None:
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.gather_output = gather_output
        self.full_output_sizes = list(output_sizes)
        sizes = [divide(s, self.tp_size, f"{prefix}: output size") for s in output_sizes]
        super().__init__(input_size, sizes, prefix=prefix, **kw)
        if self.tp_size > 1:
            shard_parameters(self, "output_dim", self._split)

    def _split(self, shard_id: Any) -> tuple[int, int, int]:
        if shard_id is None and len(self.shard_names) > 1:
            raise WeightLoadError(
                f"{self.prefix}: one checkpoint tensor for the merged shards {self.shard_names} "
                f"cannot be split across tensor-parallel ranks; load it per shard"
            )
        return self.tp_rank, 1, self.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        if self.gather_output and self.tp_size > 1:
            from llmhal.distributed.parallel_state import get_tp_group

            y = get_tp_group().all_gather(y, dim=-1)
            if len(self.output_sizes) > 1:
                # Rank-major [g0 u0 g1 u1] -> projection-major [g0 g1 u0 u1].
                parts = y.split(self.output_sizes * self.tp_size, dim=-1)
                n = len(self.output_sizes)
                y = torch.cat([parts[r * n + i] for i in range(n) for r in range(self.tp_size)], -1)
        return y


class ColumnParallelLinear(MergedColumnParallelLinear):
    """One projection split along its outputs across the tensor-parallel ranks."""

    def __init__(self, input_size: int, output_size: int, **kw: Any) -> None:
        super().__init__(input_size, [output_size], **kw)


def head_partition(
    num_heads: int, num_kv_heads: int, tp: int, rank: int
) -> tuple[int, int, int, int]:
    """(first query head, query heads, first KV head, KV heads) of tensor-parallel rank ``rank``.

    Query heads follow their KV head (grouped-query attention), so the split is by KV group: with
    at least as many KV heads as ranks, each rank takes a run of whole groups, the first
    ``num_kv_heads % tp`` ranks one group more (9 heads over 3 KV heads on 2 ranks: 6 + 3); with
    fewer, each KV head is replicated on ``tp / num_kv_heads`` ranks that share its group's query
    heads equally."""
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{num_heads} attention heads cannot share {num_kv_heads} KV heads equally"
        )
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp:
        base, extra = divmod(num_kv_heads, tp)
        kv_first = rank * base + min(rank, extra)
        kv_count = base + (rank < extra)
        return kv_first * group, kv_count * group, kv_first, kv_count
    # Fewer KV heads than ranks: each is replicated on tp / num_kv_heads ranks.
    replicas = divide(tp, num_kv_heads, f"tensor_parallel_size, over {num_kv_heads} KV heads,")
    per = divide(group, replicas, f"the query heads of one KV head, over {replicas} ranks,")
    return rank * per, per, rank // replicas, 1


class QKVParallelLinear(QKVLinear):
    """q/k/v with the attention heads split across the tensor-parallel ranks by
    :func:`head_partition` (whole KV groups per rank; a KV head replicated on several ranks when
    there are fewer KV heads than ranks). ``num_heads``/``num_kv_heads`` are the model's; the
    layer's attributes of the same names are the rank's, and ``q_heads_partition`` is the
    rank's (first, count, total) query heads, which the output projection's inputs follow."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        prefix: str = "",
        **kw: Any,
    ) -> None:
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        try:
            q0, nq, kv0, nkv = head_partition(num_heads, num_kv_heads, self.tp_size, self.tp_rank)
        except ValueError as e:
            raise ValueError(f"{prefix}: {e}") from None
        self.q_heads_partition = (q0, nq, num_heads)
        self.kv_heads_partition = (kv0, nkv, num_kv_heads)
        super().__init__(hidden_size, head_size, nq, nkv, prefix=prefix, **kw)
        if self.tp_size > 1:
            shard_parameters(self, "output_dim", self._split)

    def _split(self, shard_id: Any) -> tuple[int, int, int]:
        if shard_id == "q":
            return self.q_heads_partition
        if shard_id in ("k", "v"):
            return self.kv_heads_partition
        raise WeightLoadError(
            f"{self.prefix}: a fused q/k/v checkpoint tensor cannot be split across "
            f"tensor-parallel ranks; load q, k and v as separate shards"
        )


class RowParallelLinear(ReplicatedLinear):
    """One projection split along its inputs: rank ``r`` holds input columns
    ``[r*K/tp, (r+1)*K/tp)`` (or, with ``input_partition=(first, count, total)``, units
    ``first .. first+count-1`` of ``total`` equal units, e.g. the rank's attention heads) and takes
    the matching slice of the activations (a column-parallel layer's output). The partial
    products are summed with one all-reduce (``reduce_results``); the bias is added once, after
    the sum."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        reduce_results: bool = True,
        input_partition: tuple[int, int, int] | None = None,
        prefix: str = "",
        **kw: Any,
    ) -> None:
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.reduce_results = reduce_results
        self.full_input_size = input_size
        part = input_partition or (self.tp_rank, 1, self.tp_size)
        unit = divide(input_size, part[2], f"{prefix}: input size")
        self.input_partition = part
        # The rank's first input column: methods whose tensors index input groups (GPTQ's
        # g_idx) read it to rebase them.
        self.input_start = part[0] * unit
        super().__init__(part[1] * unit, output_size, bias=bias, prefix=prefix, **kw)
        if self.tp_size > 1:
            shard_parameters(self, "input_dim", lambda _sid: part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        from llmhal.distributed.parallel_state import get_tp_group

        y = self.quant_method.apply(self, x, None)
        if self.reduce_results:
            y = get_tp_group().all_reduce(y)
        return y if self.bias is None else y + self.bias.to(y.dtype)
