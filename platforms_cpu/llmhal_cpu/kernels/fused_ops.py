"""The native float32 kernels of the small custom ops (``fused_ops.cpp``): loading and calls.

Each function takes the op's arguments (see :mod:`llmhal.ops.native`) and returns the result, or
None when the call is not one the kernel takes (another dtype, a layout it does not read, the
library unavailable), so :mod:`llmhal_cpu.ops` falls back to its torch kernels. The library is
built on first use by :mod:`llmhal_cpu.native_build`; ``LLMHAL_CPU_OPS_KERNEL=0`` turns it off
(read once, at that first use).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from llmhal_cpu import native_build

SOURCE = Path(__file__).with_name("fused_ops.cpp")
_F32 = torch.float32


def _setup(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
    lib.llmhal_rms_norm.argtypes = [p, i64, p, i64, p, p, p, i64, i64, f32, i32]
    lib.llmhal_rotary.argtypes = [p, p, i64, i32, p, i64, i32, i32, p, i64, i64, i32, i32, i64, i32]
    lib.llmhal_silu_and_mul.argtypes = [p, i64, p, i64, i64, i32]
    for fn in (lib.llmhal_rms_norm, lib.llmhal_rotary, lib.llmhal_silu_and_mul):
        fn.restype = ctypes.c_int


LIBRARY = native_build.KernelLibrary(
    SOURCE, "fused_ops", _setup, disable_env="LLMHAL_CPU_OPS_KERNEL"
)


def load_library() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None when it cannot or may not be used."""
    return LIBRARY.get()


def _loaded() -> ctypes.CDLL | None:
    """The library for a call: once loading was tried, without re-reading the environment."""
    return LIBRARY.lib if LIBRARY.status is not None else LIBRARY.get()


def status() -> str:
    """``"native"``, or why the torch kernels run instead (for ``llmhal doctor``)."""
    if LIBRARY.disabled():
        return "torch (LLMHAL_CPU_OPS_KERNEL=0)"
    lib = LIBRARY.get()
    return (
        "native fused_ops (float32; torch for other dtypes)" if lib else f"torch ({LIBRARY.status})"
    )


def _rows(x: torch.Tensor) -> bool:
    """2-D float32 host memory with contiguous rows: the layout the kernels read."""
    # is_cpu, not device.type: building the device object costs ~1 us, ~10 checks a layer.
    return x.dtype == _F32 and x.dim() == 2 and x.stride(1) == 1 and x.is_cpu


def _vector(x: torch.Tensor, n: int) -> bool:
    """A contiguous float32 host vector of n elements."""
    return x.dtype == _F32 and x.numel() == n and x.is_contiguous() and x.is_cpu


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(normed, x + residual or None), or None when the kernel does not take these arguments."""
    lib = _loaded()
    if lib is None or not _rows(x) or not _vector(weight, x.shape[1]):
        return None
    if residual is not None and (not _rows(residual) or residual.shape != x.shape):
        return None
    t, h = x.shape
    # Explicit dtype and device: the kernel writes float32 host memory whatever torch's defaults.
    out = torch.empty(t, h, dtype=_F32, device="cpu")
    summed = None if residual is None else torch.empty(t, h, dtype=_F32, device="cpu")
    lib.llmhal_rms_norm(
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        None if summed is None else summed.data_ptr(),
        out.data_ptr(),
        weight.data_ptr(),
        t,
        h,
        eps,
        torch.get_num_threads(),
    )
    return out, summed


def rotary_(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool,
) -> bool:
    """Rotate ``query`` and ``key`` in place; False (nothing done) when the kernel does not take
    these arguments."""
    lib = _loaded()
    if lib is None or not (_rows(query) and _rows(key) and _rows(cos_sin_cache)):
        return False
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        return False
    if not positions.is_cpu:
        return False
    t, rot = query.shape[0], cos_sin_cache.shape[1]
    if positions.numel() != t or key.shape[0] != t:
        return False
    # What the native definition would reject (or the kernel would read or write past a head):
    # torch's path raises the error.
    if rot % 2 or rot > head_size or query.shape[1] % head_size or key.shape[1] % head_size:
        return False
    # An out-of-range position makes the kernel return -1 before it writes anything; torch's path
    # then raises its IndexError.
    rc = lib.llmhal_rotary(
        positions.data_ptr(),
        query.data_ptr(),
        query.stride(0),
        query.shape[1] // head_size,
        key.data_ptr(),
        key.stride(0),
        key.shape[1] // head_size,
        head_size,
        cos_sin_cache.data_ptr(),
        cos_sin_cache.stride(0),
        cos_sin_cache.shape[0],
        rot,
        int(is_neox),
        t,
        torch.get_num_threads(),
    )
    return rc == 0


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``silu(x[:, :d]) * x[:, d:]``, or None when the kernel does not take ``x``."""
    lib = _loaded()
    if lib is None or not _rows(x) or x.shape[1] % 2:
        return None
    t, d2 = x.shape
    out = torch.empty(t, d2 // 2, dtype=_F32, device="cpu")
    lib.llmhal_silu_and_mul(
        x.data_ptr(), x.stride(0), out.data_ptr(), t, d2 // 2, torch.get_num_threads()
    )
    return out
