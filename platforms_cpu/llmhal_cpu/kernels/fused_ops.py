"""The native kernels of the small custom ops (``fused_ops.cpp``): loading and calls.

Every kernel takes float32 or bfloat16 activations (a bf16 norm's weight and a bf16 rotary's cache
float32 or bf16; float32 activations need float32 ones). With bf16 taken natively, a
bf16 model's decode step makes no torch call for these ops, so it can be recorded as a step graph.
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

from llmhal_cpu import native_build, step_graph

SOURCE = Path(__file__).with_name("fused_ops.cpp")
_F32 = torch.float32
_BF16 = torch.bfloat16
_ACTS = (_F32, _BF16)


_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class RmsNormArgs(ctypes.Structure):  # mirrors fused_ops.cpp
    _fields_ = [
        ("x", _p), ("x_s", _i64), ("residual", _p), ("r_s", _i64), ("sum", _p), ("out", _p),
        ("w", _p), ("t", _i64), ("h", _i64), ("inner", _i64), ("x_s2", _i64), ("eps", _f32),
        ("threads", _i32), ("bf16", _i32), ("w_bf16", _i32),
    ]  # fmt: skip


class RotaryArgs(ctypes.Structure):
    _fields_ = [
        ("positions", _p), ("q", _p), ("q_s", _i64), ("k", _p), ("k_s", _i64), ("cache", _p),
        ("cache_s", _i64), ("max_pos", _i64), ("t", _i64), ("q_heads", _i32),
        ("k_heads", _i32), ("head_size", _i32), ("rot", _i32), ("neox", _i32),
        ("threads", _i32), ("bf16", _i32), ("cache_bf16", _i32),
    ]  # fmt: skip


class SiluAndMulArgs(ctypes.Structure):
    _fields_ = [
        ("x", _p), ("x_s", _i64), ("out", _p), ("t", _i64), ("d", _i64), ("threads", _i32),
        ("bf16", _i32),
    ]  # fmt: skip


def _setup(lib: ctypes.CDLL) -> None:
    lib.llmhal_fused_ops_args_size.argtypes = [ctypes.c_int]
    lib.llmhal_fused_ops_args_size.restype = ctypes.c_int64
    structs = (RmsNormArgs, RotaryArgs, SiluAndMulArgs)  # llmhal_fused_ops_args_size's order
    native_build.declare_struct_calls(
        lib,
        ("llmhal_rms_norm_call", "llmhal_rotary_call", "llmhal_silu_and_mul_call"),
        {s: lib.llmhal_fused_ops_args_size(i) for i, s in enumerate(structs)},
    )


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
        "native fused_ops (float32 and bfloat16; torch for other dtypes)"
        if lib
        else f"torch ({LIBRARY.status})"
    )


def _rows(x: torch.Tensor, dim: int = 2, dtypes: tuple[torch.dtype, ...] = (_F32,)) -> bool:
    """``dim``-D host memory of one of ``dtypes`` with contiguous rows: the layout the kernels
    read."""
    # is_cpu, not device.type: building the device object costs ~1 us, ~10 checks a layer.
    return x.dtype in dtypes and x.dim() == dim and x.stride(-1) == 1 and x.is_cpu


def _vector(x: torch.Tensor, n: int) -> bool:
    """A contiguous float32 or bfloat16 host vector of n elements."""
    return x.dtype in _ACTS and x.numel() == n and x.is_contiguous() and x.is_cpu


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(normed, x + residual or None), or None when the kernel does not take these arguments.

    ``x`` is [t, h] with contiguous rows, or (without ``residual``) a [t, heads, h] view with
    contiguous rows such as the per-head q/k norms of Qwen3 on a slice of the fused q/k/v output;
    ``normed`` is contiguous in ``x``'s shape and dtype. float32 ``x`` needs a float32 weight; a
    bfloat16 ``x`` (and residual) takes a weight of either dtype.
    """
    lib = _loaded()
    if lib is None or not _vector(weight, x.shape[-1]):
        return None
    dt = x.dtype
    if dt not in _ACTS or (dt == _F32 and weight.dtype != _F32):
        return None
    acts = (dt,)
    if residual is None and _rows(x, 3, acts):
        inner, x_s2 = x.shape[1], x.stride(1)
    elif _rows(x, 2, acts):
        inner, x_s2 = 1, 0
    else:
        return None
    if residual is not None and (not _rows(residual, 2, acts) or residual.shape != x.shape):
        return None
    h = x.shape[-1]
    t = x.numel() // h if h else 0
    # Explicit dtype and device: the kernel writes host memory of x's dtype whatever torch's
    # defaults.
    out = torch.empty(x.shape, dtype=dt, device="cpu")
    summed = None if residual is None else torch.empty(t, h, dtype=dt, device="cpu")
    args = RmsNormArgs(
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        None if summed is None else summed.data_ptr(),
        out.data_ptr(),
        weight.data_ptr(),
        t,
        h,
        inner,
        x_s2,
        eps,
        torch.get_num_threads(),
        int(dt == _BF16),
        int(weight.dtype == _BF16),
    )
    step_graph.launch(lib.llmhal_rms_norm_call, args)
    return out, summed


def _head_rows(x: torch.Tensor, head_size: int, dt: torch.dtype) -> tuple[int, int] | None:
    """(heads, head stride) of ``x``: [t, heads * head_size] with contiguous rows, or a
    [t, heads, head_size] view with contiguous heads at any stride (e.g. DeepSeek's rotary part of
    each query head, the last 64 of its 192 values); None when the kernel does not address it."""
    if _rows(x, 2, (dt,)) and x.shape[1] % head_size == 0:
        return x.shape[1] // head_size, head_size
    if _rows(x, 3, (dt,)) and x.shape[2] == head_size:
        return x.shape[1], x.stride(1)
    return None


def rotary_(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool,
) -> bool:
    """Rotate ``query`` and ``key`` in place; False (nothing done) when the kernel does not take
    these arguments. Each is [t, heads * head_size] or a [t, heads, head_size] view (see
    :func:`_head_rows`)."""
    lib = _loaded()
    dt = query.dtype
    if lib is None or dt not in _ACTS or key.dtype != dt:
        return False
    q_heads, k_heads = _head_rows(query, head_size, dt), _head_rows(key, head_size, dt)
    if q_heads is None or k_heads is None:
        return False
    # The kernel steps from head to head by one stride for both: they must agree, unless one of
    # them has a single head (no step taken).
    if q_heads[1] != k_heads[1] and q_heads[0] > 1 and k_heads[0] > 1:
        return False
    stride = q_heads[1] if q_heads[0] > 1 else k_heads[1]
    if not _rows(cos_sin_cache, 2, (_F32,) if dt == _F32 else _ACTS):
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
    if rot % 2 or rot > head_size:
        return False
    # An out-of-range position makes the kernel return -1 before it writes anything; torch's path
    # then raises its IndexError.
    args = RotaryArgs(
        positions=positions.data_ptr(),
        q=query.data_ptr(),
        q_s=query.stride(0),
        k=key.data_ptr(),
        k_s=key.stride(0),
        cache=cos_sin_cache.data_ptr(),
        cache_s=cos_sin_cache.stride(0),
        max_pos=cos_sin_cache.shape[0],
        t=t,
        q_heads=q_heads[0],
        k_heads=k_heads[0],
        head_size=stride,  # the kernel's head step; it rotates the first rot values of each
        rot=rot,
        neox=int(is_neox),
        threads=torch.get_num_threads(),
        bf16=int(dt == _BF16),
        cache_bf16=int(cos_sin_cache.dtype == _BF16),
    )
    return step_graph.launch(lib.llmhal_rotary_call, args) == 0


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``silu(x[:, :d]) * x[:, d:]`` (float32 or bfloat16), or None when the kernel does not take
    ``x``."""
    lib = _loaded()
    if lib is None or not _rows(x, 2, _ACTS) or x.shape[1] % 2:
        return None
    t, d2 = x.shape
    out = torch.empty(t, d2 // 2, dtype=x.dtype, device="cpu")
    args = SiluAndMulArgs(
        x.data_ptr(), x.stride(0), out.data_ptr(), t, d2 // 2, torch.get_num_threads(),
        int(x.dtype == _BF16),
    )  # fmt: skip
    step_graph.launch(lib.llmhal_silu_and_mul_call, args)
    return out
