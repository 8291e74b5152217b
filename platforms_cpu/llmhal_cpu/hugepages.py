"""Host memory on transparent huge pages, for the packed weights the kernels stream every step.

A batch-1 decode reads every weight once per token (SmolLM2: ~90 MB of 4- and 8-bit codes and
scales), spread over ~120 tensors of 0.1-30 MB. On 4 KiB pages that is one TLB miss and page walk
per 4 KiB streamed. Linux backs memory with 2 MiB pages only where asked (``madvise``, the usual
``transparent_hugepage=madvise`` setting), and only in 2 MiB-aligned stretches, which small tensors
never are. :class:`HugePageArena` hands out 64-byte-aligned pieces of large 2 MiB-aligned slabs
advised ``MADV_HUGEPAGE`` before their first touch. Measured on a 2-core Zen 3 VM (SmolLM2 Q4_1):
every weight's matmul at M=1 3-5% faster, batch-1 decode 4-9% (interleaved A/B in one process).

Pieces are views of their slab's storage, so a slab is freed when the last tensor on it is; the
arena keeps only the slab it is filling. Where ``madvise`` is missing or refused (other systems,
THP off) the slabs are ordinary memory.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from typing import Any

import torch

HUGE_PAGE = 2 << 20
SLAB_BYTES = 32 << 20
MADV_HUGEPAGE = 14
_ALIGN = 64


@functools.cache
def _madvise() -> Any:
    """libc's ``madvise``, looked up once (the process has libc loaded); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def _madvise_hugepage(addr: int, nbytes: int) -> bool:
    """Ask Linux for huge pages on [addr, addr + nbytes) (2 MiB aligned); False where unavailable."""
    fn = _madvise()
    return fn is not None and fn(addr, nbytes, MADV_HUGEPAGE) == 0


class HugePageArena:
    """Hands out byte buffers from huge-page-advised slabs (see the module docstring)."""

    def __init__(self, slab_bytes: int = SLAB_BYTES) -> None:
        self.slab_bytes = slab_bytes
        self._slab: torch.Tensor | None = None
        self._used = 0
        self._lock = threading.Lock()
        self.advised = 0  # bytes madvise accepted (0 where the OS does not take the advice)

    def _new_slab(self, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        # Fresh pages: advice given before the first write decides how they are backed.
        raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % HUGE_PAGE
        slab = raw[start : start + size]
        if _madvise_hugepage(slab.data_ptr(), size):
            self.advised += size
        return slab

    def empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 tensor of ``nbytes`` bytes, 64-byte aligned."""
        nbytes = max(int(nbytes), 1)
        with self._lock:
            if nbytes > self.slab_bytes // 2:  # large: a slab of its own
                return self._new_slab(nbytes)[:nbytes]
            if self._slab is None or self._used + nbytes > self._slab.numel():
                self._slab, self._used = self._new_slab(self.slab_bytes), 0
            piece = self._slab[self._used : self._used + nbytes]
            self._used = -(-(self._used + nbytes) // _ALIGN) * _ALIGN
            return piece

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``t`` in the arena (same dtype and shape)."""
        out = self.empty(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
        out.copy_(t)
        return out
