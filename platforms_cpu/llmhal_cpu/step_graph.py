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
* torch only allocates and takes views (a ``TorchFunctionMode`` watches every torch call): a call
  that computes or reads values (a torch matmul, a fallback kernel, an fp8 cast, ``tensor.item()``)
  would not be replayed, so the capture is refused with that call's name as the reason, and the
  step's eager result is still used;
* the buffers the calls touch stay alive: what torch allocates during a capture comes from a
  :class:`StoragePool` that the graph keeps. The pool reuses memory the way an eager step does (a
  buffer no tensor refers to any more serves the next allocation that fits), and graphs recorded
  with the same pool share it (they never replay at once), so a graph costs about one layer's
  intermediates, not the whole step's.

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
from torch.overrides import TorchFunctionMode

from llmhal.utils.tensors import tensors_in
from llmhal_cpu import native_build

SOURCE = Path(__file__).with_name("kernels") / "step_replay.cpp"
T = TypeVar("T")

# Calls that only allocate memory (the replayed kernels write it).
_ALLOCATORS = {
    torch.empty,
    torch.empty_like,
    torch.empty_strided,
    torch.Tensor.new_empty,
    torch.Tensor.new_empty_strided,
}
# Calls that read a tensor's metadata, not its values (``__get__``: properties such as .shape).
_METADATA = {
    "__get__", "data_ptr", "stride", "size", "dim", "ndimension", "numel", "nelement",
    "is_contiguous", "element_size", "storage_offset", "untyped_storage", "get_device",
    "is_floating_point", "__len__",
}  # fmt: skip


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


class StoragePool:
    """The memory of recorded steps' buffers (see the module docstring).

    A pooled storage is free when nothing but the pool refers to it (its use count is 1): the
    tensors of an earlier layer, or of an earlier capture, that Python has dropped. Graphs that
    share a pool must not replay concurrently; each replay rewrites every buffer it reads.
    """

    def __init__(self) -> None:
        self._storages: list[torch.UntypedStorage] = []

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self._storages)

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (freshly allocated) moved to the smallest free pooled storage that holds it, or
        kept, its storage joining the pool."""
        need = t.untyped_storage().nbytes()
        free = [
            s
            for s in self._storages
            if s.nbytes() >= need and torch._C._storage_Use_Count(s._cdata) == 1
        ]
        if not free:
            self._storages.append(t.untyped_storage())
            return t
        best = min(free, key=lambda s: s.nbytes())
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(best, 0, t.shape, t.stride())


class _CaptureGuard(TorchFunctionMode):
    """Keeps what torch allocates during a capture and names the first call that does more.

    A function mode (torch's Python API level) rather than a dispatch mode: entering a
    ``TorchDispatchMode`` imports ``torch._dynamo`` (~1.7 s, once per process), which would land on
    the first decode step of every ``llmhal generate``. At this level a call is accepted when it
    allocates, reads metadata, or returns views of its inputs (``view``, ``split``, a ``reshape``
    or ``contiguous`` that needs no copy, basic slicing); anything that computes, copies, writes in
    place or reads values (``.item()``) refuses the capture.
    """

    def __init__(self, pool: StoragePool) -> None:
        super().__init__()
        self.pool = pool
        self.refused: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATORS:
            out = self.pool.place(out)
        elif self.refused is None and not _passive(func, args, kwargs, out):
            # A torch op packet's __qualname__ is its pybind11 record: its qualified name reads.
            name = (
                getattr(func, "_qualified_op_name", None)
                or getattr(func, "__qualname__", None)
                or getattr(func, "__name__", repr(func))
            )
            self.refused = f"the step calls torch's {name} (only native kernels are replayed)"
        return out


def _passive(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None, out: Any) -> bool:
    """True when ``func`` computed nothing: a metadata read, or views of its inputs."""
    name = getattr(func, "__name__", "")
    results = tensors_in(out)
    if not results:
        return name in _METADATA
    if (name.endswith("_") and not name.endswith("__")) or name == "__setitem__":
        return False  # in place: the result is its input, but its values changed
    # Opaque tensors (oneDNN's packed weights, kernels/dense_linear.py) have no storage to compare:
    # a result is a view only of the strided inputs.
    inputs = {
        t.untyped_storage().data_ptr()
        for t in tensors_in([*args, *(kwargs or {}).values()])
        if t.layout == torch.strided
    }
    return all(
        t.layout == torch.strided and t.untyped_storage().data_ptr() in inputs for t in results
    )


class CpuStepGraph:
    """A recorded list of native kernel calls (see the module docstring)."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        calls: list[tuple[Any, ctypes.Structure]],
        pool: StoragePool,
        output: Any,
    ) -> None:
        self._lib = lib
        self._calls = calls  # holds the argument structs the pointers below point into
        self.pool = pool  # and the buffers those structs point to
        self._output = output
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
                f"replayed kernel call {rc - 1} ({getattr(fn, '__name__', fn)}) returned an error; "
                "the eager call would have raised too (e.g. rotary: a position past its table)"
            )


def capture(
    run: Callable[[], T], pool: StoragePool | None = None
) -> tuple[T, CpuStepGraph | None, str | None]:
    """Run ``run()`` once, recording its native calls: ``(its result, the graph or None, why not)``.

    The result is the real one either way (the step ran); the graph replays the same calls.
    ``pool``: an earlier graph's :attr:`CpuStepGraph.pool` to share (default: a new one).
    """
    lib = LIBRARY.get()
    if lib is None:
        return run(), None, f"the replay library is unavailable ({LIBRARY.status})"
    if getattr(_state, "record", None) is not None:
        raise RuntimeError("a step graph is already being captured on this thread")
    calls: list[tuple[Any, ctypes.Structure]] = []
    guard = _CaptureGuard(pool or StoragePool())
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
    return out, CpuStepGraph(lib, calls, guard.pool, out), None
