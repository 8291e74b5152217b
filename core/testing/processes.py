"""Process checks for tests of multi-process engines: has a process exited, and wait until all
of some have (no orphan left behind)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie, exited but not yet reaped, has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pids: Iterable[int], bound_s: float) -> float:
    """Wait until every process in ``pids`` has exited; AssertionError after ``bound_s`` seconds.
    Returns the seconds waited."""
    pids = list(pids)
    t0 = time.monotonic()
    while not all(map(process_gone, pids)):
        left = [p for p in pids if not process_gone(p)]
        assert time.monotonic() - t0 < bound_s, f"still running after {bound_s} s: {left}"
        time.sleep(0.05)
    return time.monotonic() - t0
