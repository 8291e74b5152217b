"""CPU step graphs: record the native kernel calls of a step once, then replay them from C.

A batch-1 decode of a small model spends about as long in Python (module calls, argument checks,
ctypes conversions: ~6 ms a step for SmolLM2's 30 layers) as in its kernels. When every op of a
step is one of this platform's native kernels, the step is the same list of C calls each time,
on the same buffers; only the values in the inputs change. So the engine runs the step once while
:func:`capture` records each :func:`launch` (the kernel's function pointer and its argument
struct), and later steps refill the input buffers and call :meth:`CpuStepGraph.replay`: one
ctypes call that makes every kernel call in order (``kernels/step_replay.cpp``).

What makes a step capturable, checked while it is captured:

* every native kernel call goes through :func:`launch` (all of this package's do);
* torch only allocates and takes views (a ``TorchDispatchMode`` watches every op): any op that
  computes or reads values (a torch matmul, a fallback kernel, an fp8 cast, ``tensor.item()``)
  would not be replayed, so the capture is refused with that op's name as the reason, and the
  step's eager result is still used;
* the buffers the calls touch stay alive: the graph keeps every tensor allocated during capture.

This is the CPU analogue of a CUDA graph, with the same rules for the caller: inputs live in
static buffers, outputs are overwritten by the next replay, and the graph is invalid once any
buffer it uses (the KV cache, the weights) is replaced.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmhal_cpu import native_build

SOURCE = Path(__file__).with_name("kernels") / "step_replay.cpp"
T = TypeVar("T")

_aten = torch.ops.aten
# Ops that only allocate or make views: the replayed kernels write the allocated memory, and views
# keep pointing where they did.
_ALLOCATING = {
    _aten.empty.memory_format,
    _aten.empty_like.default,
    _aten.empty_strided.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
}
_VIEWS = {
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.alias.default,
    _aten.as_strided.default,
    _aten.slice.Tensor,
    _aten.select.int,
    _aten.split.Tensor,
    _aten.split_with_sizes.default,
    _aten.t.default,
    _aten.transpose.int,
    _aten.permute.default,
    _aten.unsqueeze.default,
    _aten.squeeze.dim,
    _aten.squeeze.default,
    _aten.expand.default,
    _aten.detach.default,
}


def _setup(lib: ctypes.CDLL) -> None:
    lib.llmhal_step_replay.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.llmhal_step_replay.restype = ctypes.c_int64


LIBRARY = native_build.KernelLibrary(SOURCE, "step_replay", _setup)
_state = threading.local()


def launch(fn: Any, args: ctypes.Structure) -> int:
    """Call native kernel ``fn`` (``int fn(const void*)``) on ``args``; recorded while capturing."""
    record = getattr(_state, "record", None)
    if record is not None:
        record.append((fn, args))
    return int(fn(ctypes.byref(args)))


class _CaptureGuard(TorchDispatchMode):
    """Keeps what torch allocates during a capture and names the first op that does more."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated: list[torch.Tensor] = []
        self.refused: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATING:
            self.allocated.append(out)
        elif func not in _VIEWS and not _returns_view(func, args, out) and self.refused is None:
            self.refused = f"the step runs torch op {func} (only native kernels are replayed)"
        return out


def _returns_view(func: Any, args: tuple[Any, ...], out: Any) -> bool:
    """A non-mutating op whose result shares its input's memory (``reshape`` or ``contiguous``
    of a tensor that needs no copy): nothing computed, nothing to replay."""
    if func._schema.is_mutable or not isinstance(out, torch.Tensor):
        return False
    ptr = out.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr for a in args)


class CpuStepGraph:
    """A recorded list of native kernel calls (see the module docstring)."""

    def __init__(
        self, lib: ctypes.CDLL, calls: list[tuple[Any, ctypes.Structure]], keep: list[Any]
    ) -> None:
        self._lib = lib
        self._calls = calls  # holds the argument structs the pointers below point into
        self._keep = keep  # and the buffers those structs point to
        n = len(calls)
        self._fns = (ctypes.c_void_p * n)(
            *(ctypes.cast(f, ctypes.c_void_p).value for f, _ in calls)
        )
        self._args = (ctypes.c_void_p * n)(*(ctypes.addressof(a) for _, a in calls))
        self.num_calls = n

    def replay(self) -> None:
        rc = self._lib.llmhal_step_replay(self._fns, self._args, self.num_calls)
        if rc:
            fn = self._calls[rc - 1][0]
            raise RuntimeError(
                f"replayed kernel call {rc - 1} ({getattr(fn, '__name__', fn)}) failed: an input "
                "is out of range (e.g. a position past the rotary table)"
            )


def capture(run: Callable[[], T]) -> tuple[T, CpuStepGraph | None, str | None]:
    """Run ``run()`` once, recording its native calls: ``(its result, the graph or None, why not)``.

    The result is the real one either way (the step ran); the graph replays the same calls.
    """
    lib = LIBRARY.get()
    if lib is None:
        return run(), None, f"the replay library is unavailable ({LIBRARY.status})"
    if getattr(_state, "record", None) is not None:
        raise RuntimeError("a step graph is already being captured on this thread")
    calls: list[tuple[Any, ctypes.Structure]] = []
    guard = _CaptureGuard()
    _state.record = calls
    try:
        with guard:
            out = run()
    finally:
        _state.record = None
    if guard.refused is not None:
        return out, None, guard.refused
    if not calls:
        return out, None, "the step made no native kernel calls"
    return out, CpuStepGraph(lib, calls, [guard.allocated, out]), None
