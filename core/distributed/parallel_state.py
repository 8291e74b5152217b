"""Process groups for tensor and pipeline parallelism (vLLM's layout and names).

``init_distributed(world_size, rank, init_method, tensor_parallel_size, pipeline_parallel_size)``
is called once per worker process, before the model is built. The world's ranks are laid out
stage-major: rank ``r`` is tensor-parallel rank ``r % tp`` of pipeline stage ``r // tp``, so a
tensor-parallel group is ``tp`` consecutive ranks and a pipeline group is the ranks ``tp`` apart.

Until then (and after ``destroy_distributed``) every group is the trivial world of one process:
``get_tp_group().world_size == 1`` and each collective returns its input without touching
``torch.distributed``, so single-process code paths are unchanged and cost nothing.

Each group holds two torch process groups over the same ranks: the device group on the platform's
``dist_backend`` (tensors) and a gloo group (Python objects, metadata). The collectives go through
the platform's device communicator (:mod:`llmhal.distributed.communicator`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llmhal.distributed import stats as _stats

if TYPE_CHECKING:  # pragma: no cover
    import torch


class GroupCoordinator:
    """One group of ranks and its collectives. Ranks are given in the group's own numbering
    (``rank_in_group``), 0 to ``world_size - 1``; the world's numbering is ``ranks[i]``."""

    def __init__(
        self,
        name: str,
        ranks: Sequence[int],
        rank: int,
        *,
        device_group: Any = None,
        cpu_group: Any = None,
        communicator: Any = None,
        device: Any = None,
    ) -> None:
        self.name = name
        self.ranks = list(ranks)
        self.rank = rank
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(rank)
        self.device_group = device_group
        self.cpu_group = cpu_group
        self.communicator = communicator
        self.device = device
        # Seconds spent in send_tensor_dict and recv_tensor_dict: a pipeline stage waiting for its
        # neighbours (gloo's send returns once the receiver has taken the tensors), which
        # llmhal.distributed.pipeline.StageClock takes out of a stage's busy time.
        self.p2p_seconds = 0.0

    # ------------------------------------------------------------------------------- position
    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """The group rank after this one (wrapping), where a pipeline stage sends its output."""
        return (self.rank_in_group + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        return (self.rank_in_group - 1) % self.world_size

    # ---------------------------------------------------------------------------- collectives
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the group's ranks (``t`` itself when the group has one rank)."""
        if self.world_size == 1:
            return t
        with _stats.timed("all_reduce", self.name, t):
            return self.communicator.all_reduce(t)

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``t`` concatenated along ``dim``, in rank order."""
        if self.world_size == 1:
            return t
        with _stats.timed("all_gather", self.name, t):
            return self.communicator.all_gather(t, dim)

    def gather(self, t: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """``all_gather`` delivered to ``dst`` only; the other ranks get None."""
        if self.world_size == 1:
            return t
        with _stats.timed("gather", self.name, t):
            return self.communicator.gather(t, dst, dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return t
        with _stats.timed("reduce_scatter", self.name, t):
            return self.communicator.reduce_scatter(t, dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s ``t`` on every rank (in place)."""
        if self.world_size == 1:
            return t
        with _stats.timed("broadcast", self.name, t):
            return self.communicator.broadcast(t, src)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """A picklable object from ``src`` to every rank (over the gloo group)."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank_in_group == src else None]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        import torch.distributed as dist

        dist.barrier(group=self.cpu_group)

    # ------------------------------------------------------------------ point to point (PP)
    def send(self, t: torch.Tensor, dst: int | None = None) -> None:
        """Send ``t`` to group rank ``dst`` (default: the next rank)."""
        self._check_p2p()
        with _stats.timed("send", self.name, t):
            self.communicator.send(t, self.next_rank if dst is None else dst)

    def recv(self, size: Sequence[int], dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        """Receive a tensor of ``size`` and ``dtype`` from group rank ``src`` (default: previous)."""
        self._check_p2p()
        t = self.communicator.recv(tuple(size), dtype, self.prev_rank if src is None else src)
        _stats.record("recv", self.name, t, 0.0)
        return t

    def send_tensor_dict(self, tensors: dict[str, torch.Tensor], dst: int | None = None) -> None:
        """Send named tensors (e.g. a pipeline stage's IntermediateTensors): their names, shapes
        and dtypes first over the gloo group, then each tensor on the device group."""
        import torch.distributed as dist

        self._check_p2p()
        dst = self.next_rank if dst is None else dst
        meta = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
        t0 = time.perf_counter()
        dist.send_object_list([meta], dst=self.ranks[dst], group=self.cpu_group)
        for _, t in tensors.items():
            self.send(t, dst)
        self.p2p_seconds += time.perf_counter() - t0

    def recv_tensor_dict(self, src: int | None = None) -> dict[str, torch.Tensor]:
        import torch.distributed as dist

        self._check_p2p()
        src = self.prev_rank if src is None else src
        box: list[Any] = [None]
        t0 = time.perf_counter()
        dist.recv_object_list(box, src=self.ranks[src], group=self.cpu_group)
        got = {name: self.recv(shape, dtype, src) for name, shape, dtype in box[0]}
        self.p2p_seconds += time.perf_counter() - t0
        return got

    def _check_p2p(self) -> None:
        if self.world_size == 1:
            raise RuntimeError(
                f"send/recv in group {self.name!r} of one rank: there is no other stage; a "
                f"pipeline needs pipeline_parallel_size > 1 (init_distributed)"
            )

    def destroy(self) -> None:
        if self.communicator is not None:
            self.communicator.destroy()
            self.communicator = None

    def __repr__(self) -> str:
        return (
            f"GroupCoordinator({self.name}, rank {self.rank_in_group} of {self.world_size}, "
            f"world ranks {self.ranks})"
        )


def _trivial(name: str) -> GroupCoordinator:
    return GroupCoordinator(name, [0], 0)


_lock = threading.Lock()
_groups: dict[str, GroupCoordinator] = {}


def _group(name: str) -> GroupCoordinator:
    g = _groups.get(name)
    return g if g is not None else _trivial(name)


def get_world_group() -> GroupCoordinator:
    return _group("world")


def get_tp_group() -> GroupCoordinator:
    """This rank's tensor-parallel group (the trivial group of one before ``init_distributed``)."""
    return _group("tp")


def get_pp_group() -> GroupCoordinator:
    """This rank's pipeline group: stage ``rank_in_group`` of ``world_size`` stages."""
    return _group("pp")


def distributed_initialized() -> bool:
    return bool(_groups)


def _layout(world_size: int, tp: int, pp: int) -> tuple[list[list[int]], list[list[int]]]:
    """(tensor-parallel groups, pipeline groups) as lists of world ranks."""
    tp_groups = [list(range(s * tp, (s + 1) * tp)) for s in range(pp)]
    pp_groups = [list(range(t, world_size, tp)) for t in range(tp)]
    return tp_groups, pp_groups


def init_distributed(
    world_size: int,
    rank: int,
    distributed_init_method: str,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    backend: str | None = None,
    *,
    local_rank: int | None = None,
    join_timeout_s: float | None = None,
) -> None:
    """Join the world (``torch.distributed.init_process_group``) and build the tp/pp groups.

    ``distributed_init_method``: a URL such as ``tcp://127.0.0.1:29500`` or ``env://``.
    ``backend``: the torch.distributed backend; default ``current_platform.dist_backend``.
    ``local_rank``: the device index on this host (default ``rank``). Every rank calls this with
    the same sizes; it returns once all groups exist. Calling it again in the same process is an
    error (call ``destroy_distributed`` first). ``join_timeout_s``: give up joining the world
    after that long (default: torch's 30 minutes); its collectives keep the default timeout.
    """
    tp, pp = int(tensor_parallel_size), int(pipeline_parallel_size)
    if tp < 1 or pp < 1:
        raise ValueError(
            f"tensor_parallel_size={tp} and pipeline_parallel_size={pp} must both be >= 1"
        )
    if tp * pp != world_size:
        raise ValueError(
            f"world_size={world_size} must equal tensor_parallel_size x pipeline_parallel_size "
            f"= {tp} x {pp} = {tp * pp}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank={rank} is outside the world of {world_size} ranks (0..{world_size - 1})"
        )
    import torch.distributed as dist

    from llmhal.platforms import current_platform
    from llmhal.utils.imports import resolve_obj_by_qualname

    with _lock:
        if _groups:
            raise RuntimeError(
                "init_distributed was already called in this process; call "
                "llmhal.distributed.destroy_distributed() first"
            )
        backend = backend or current_platform.dist_backend
        if not backend:
            raise RuntimeError(
                f"platform {current_platform.name!r} names no dist_backend (torch.distributed "
                f"backend); pass backend='gloo' (CPU) or use a platform that sets one"
            )
        if not dist.is_initialized():
            from datetime import timedelta

            from torch.distributed import distributed_c10d

            bounded = {} if join_timeout_s is None else {"timeout": timedelta(seconds=join_timeout_s)}  # fmt: skip
            # torch counts a failed join's group all the same, and names the next default group
            # after that count: a later engine's join would wait under another name than its new
            # peers use, forever. A failed join is forgotten.
            count = getattr(distributed_c10d._world, "group_count", None)
            try:
                dist.init_process_group(
                    backend=backend,
                    init_method=distributed_init_method,
                    world_size=world_size,
                    rank=rank,
                    **bounded,
                )
            except BaseException:
                if count is not None and not dist.is_initialized():
                    distributed_c10d._world.group_count = count
                raise
            if bounded:
                # The bound is for joining only; collectives keep torch's default timeout (a
                # step's collective may wait on a long prefill of another rank).
                from torch.distributed.distributed_c10d import _set_pg_timeout, default_pg_timeout

                _set_pg_timeout(default_pg_timeout)
        local_rank = rank if local_rank is None else local_rank
        device = current_platform.torch_device(local_rank)
        if device.type != "cpu":
            current_platform.set_device(device)
        comm_cls = resolve_obj_by_qualname(current_platform.get_device_communicator_cls())
        tp_groups, pp_groups = _layout(world_size, tp, pp)
        built: dict[str, GroupCoordinator] = {}
        for name, layout in (
            ("world", [list(range(world_size))]),
            ("tp", tp_groups),
            ("pp", pp_groups),
        ):
            # new_group is collective: every rank creates every group, in the same order.
            for ranks in layout:
                device_group = (
                    dist.group.WORLD if name == "world" else dist.new_group(ranks, backend=backend)
                )
                cpu_group = (
                    device_group if backend == "gloo" else dist.new_group(ranks, backend="gloo")
                )
                if rank in ranks:
                    comm = (
                        comm_cls(cpu_group, device, device_group, f"{name}:{ranks}")
                        if len(ranks) > 1
                        else None
                    )
                    built[name] = GroupCoordinator(
                        name, ranks, rank, device_group=device_group, cpu_group=cpu_group,
                        communicator=comm, device=device,
                    )  # fmt: skip
        _groups.update(built)


def destroy_distributed() -> None:
    """Leave the world and return to the trivial groups (a no-op when not initialized)."""
    with _lock:
        for g in _groups.values():
            g.destroy()
        _groups.clear()
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover
            return
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
