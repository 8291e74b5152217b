"""Counting collectives: how many calls, how many bytes, how long (for measurements, off by default).

``with record_collectives() as stats:`` counts every collective a group of
:mod:`llmhal.distributed.parallel_state` runs in this process until the block ends; ``stats.summary()``
gives, per operation and group, the calls, the bytes of the tensors passed in (the payload per rank,
not the wire traffic, which depends on the algorithm: a ring all-reduce moves ``2(n-1)/n`` times the
payload per rank) and the wall time spent waiting in the call. Outside such a block the hook costs
one global read.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class CollectiveStats:
    ops: dict[tuple[str, str], OpStats] = field(default_factory=dict)

    def add(self, op: str, group: str, nbytes: int, seconds: float) -> None:
        s = self.ops.setdefault((op, group), OpStats())
        s.calls += 1
        s.bytes += nbytes
        s.seconds += seconds

    def summary(self) -> dict[str, dict[str, float]]:
        """``"op/group" -> {calls, bytes, seconds, mean_us, mean_bytes}``."""
        out = {}
        for (op, group), s in sorted(self.ops.items()):
            out[f"{op}/{group}"] = {
                "calls": s.calls,
                "bytes": s.bytes,
                "seconds": s.seconds,
                "mean_us": 1e6 * s.seconds / s.calls if s.calls else 0.0,
                "mean_bytes": s.bytes / s.calls if s.calls else 0.0,
            }
        return out


_active: CollectiveStats | None = None
_lock = threading.Lock()


@contextlib.contextmanager
def record_collectives() -> Iterator[CollectiveStats]:
    """Count the collectives run in this process inside the block (nested blocks share one)."""
    global _active
    with _lock:
        outer = _active
        stats = outer if outer is not None else CollectiveStats()
        _active = stats
    try:
        yield stats
    finally:
        with _lock:
            _active = outer


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size()) if t is not None else 0


def record(op: str, group: str, t: Any, seconds: float) -> None:
    stats = _active
    if stats is not None:
        stats.add(op, group, _nbytes(t), seconds)


@contextlib.contextmanager
def timed(op: str, group: str, t: Any) -> Iterator[None]:
    stats = _active
    if stats is None:
        yield
        return
    start = time.perf_counter()
    yield
    stats.add(op, group, _nbytes(t), time.perf_counter() - start)
