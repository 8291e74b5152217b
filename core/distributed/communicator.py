"""The device communicator: the collectives parallel layers use, over one process group.

The platform names the class (``Platform.get_device_communicator_cls()``, a class path; vLLM's
name). Core's :class:`DeviceCommunicatorBase` runs every collective through ``torch.distributed``
on the group's device group (whatever ``dist_backend`` the platform names: gloo, nccl, ...); a
vendor package may subclass it to use its own library (a custom all-reduce, a fabric API) and is
given the same groups. Parallel layers never call ``torch.distributed`` themselves.

Contract (every member is called with the group's ranks all taking part, in the same order):

``__init__(cpu_group, device=None, device_group=None, unique_name="")``
    ``cpu_group`` is a gloo group over the same ranks (objects and metadata travel there);
    ``device_group`` the group on the platform's backend (tensors on ``device``).
``all_reduce(t) -> t``      sum over ranks; may work in place and return ``t``.
``all_gather(t, dim) -> t`` the ranks' tensors concatenated along ``dim`` in rank order.
``gather(t, dst, dim)``     as ``all_gather`` on ``dst`` (a rank in the group); None elsewhere.
``reduce_scatter(t, dim)``  the sum, split along ``dim``, this rank's part.
``broadcast(t, src) -> t``  ``src``'s tensor on every rank (in place).
``send(t, dst)`` / ``recv(size, dtype, src) -> t``  point to point, ranks in the group.
``destroy()``               release what the communicator holds (the groups belong to the caller).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class DeviceCommunicatorBase:
    """Collectives over ``torch.distributed`` on the group's device group (tensors stay on their
    device; gloo and nccl both serve it)."""

    def __init__(
        self,
        cpu_group: Any,
        device: torch.device | None = None,
        device_group: Any = None,
        unique_name: str = "",
    ) -> None:
        self.cpu_group = cpu_group
        self.device_group = device_group if device_group is not None else cpu_group
        self.device = device if device is not None else torch.device("cpu")
        self.unique_name = unique_name
        self.ranks: list[int] = dist.get_process_group_ranks(self.cpu_group)
        self.rank = dist.get_rank()
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(self.rank)

    def _global(self, rank_in_group: int) -> int:
        if not 0 <= rank_in_group < self.world_size:
            raise ValueError(
                f"rank {rank_in_group} is not in group {self.unique_name!r} of {self.world_size}"
            )
        return self.ranks[rank_in_group]

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.device_group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t, group=self.device_group)
        return torch.cat(parts, dim=dim)

    def gather(self, t: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        t = t.contiguous()
        mine = self.rank_in_group == dst
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if mine else None
        dist.gather(t, parts, dst=self._global(dst), group=self.device_group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def reduce_scatter(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        # Written as all-reduce then slice: gloo has no reduce_scatter, and the layers here do
        # not need it on the hot path.
        total = self.all_reduce(t.clone())
        return total.chunk(self.world_size, dim=dim)[self.rank_in_group].contiguous()

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(t, src=self._global(src), group=self.device_group)
        return t

    def send(self, t: torch.Tensor, dst: int) -> None:
        dist.send(t.contiguous(), dst=self._global(dst), group=self.device_group)

    def recv(
        self, size: torch.Size | tuple[int, ...], dtype: torch.dtype, src: int
    ) -> torch.Tensor:
        t = torch.empty(size, dtype=dtype, device=self.device)
        dist.recv(t, src=self._global(src), group=self.device_group)
        return t

    def destroy(self) -> None:
        pass
