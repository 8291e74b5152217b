"""The native few-row linear kernel (``rows_linear.cpp``): ``x @ W.T + bias`` for decode steps.

:func:`rows_linear` runs a linear layer on up to :data:`MAX_ROWS` rows in one native call,
launched through :func:`llmhal_cpu.step_graph.launch` so a decode step of an unquantized model can
be recorded as a step graph (a torch or oneDNN product cannot be). It streams the weight once for
all rows with float32 accumulation, so it differs from a GEMM only in the order of the sums. It
returns None when the call is not one it takes (more rows, a dtype it does not read, a weight
that is not [N, K] or a bias that is not [N], a tensor off the host, the library unavailable);
:mod:`llmhal_cpu.kernels.dense_linear` then runs the GEMM (``F.linear``, which names the shapes it
refuses). Built on first use by :mod:`llmhal_cpu.native_build`; ``LLMHAL_CPU_ROWS_KERNEL=0`` turns
it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from llmhal_cpu import native_build, step_graph

SOURCE = Path(__file__).with_name("rows_linear.cpp")
# Above this many rows the product turns compute-bound and a GEMM's blocking wins.
MAX_ROWS = 8
_TYPES = (torch.float32, torch.bfloat16)
_BF16 = torch.bfloat16

_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class RowsLinearArgs(ctypes.Structure):  # mirrors rows_linear.cpp
    _fields_ = [
        ("x", _p), ("x_s", _i64), ("w", _p), ("bias", _p), ("out", _p), ("t", _i64),
        ("k", _i64), ("n", _i64), ("x_bf16", _i32), ("w_bf16", _i32), ("bias_bf16", _i32),
        ("out_bf16", _i32), ("threads", _i32),
    ]  # fmt: skip


def _setup(lib: ctypes.CDLL) -> None:
    lib.llmhal_rows_linear_args_size.argtypes = []
    lib.llmhal_rows_linear_args_size.restype = ctypes.c_int64
    native_build.declare_struct_calls(
        lib, ("llmhal_rows_linear_call",), {RowsLinearArgs: lib.llmhal_rows_linear_args_size()}
    )


LIBRARY = native_build.KernelLibrary(
    SOURCE, "rows_linear", _setup, disable_env="LLMHAL_CPU_ROWS_KERNEL"
)


def status() -> str:
    """Whether the kernel runs (for ``llmhal doctor``)."""
    if LIBRARY.disabled():
        return "off (LLMHAL_CPU_ROWS_KERNEL=0)"
    return f"native, up to {MAX_ROWS} rows" if LIBRARY.get() else f"unavailable ({LIBRARY.status})"


def rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``x @ weight.T + bias`` in ``weight``'s dtype, or None.

    ``x`` [..., K] with contiguous rows, at most :data:`MAX_ROWS` of them, float32 or bfloat16
    (a float32 weight takes either: the kernel widens bf16 exactly, as ``x.float()`` would);
    ``weight`` [N, K] contiguous float32 or bfloat16; ``bias`` [N] float32 or bfloat16.
    """
    if weight.dim() != 2 or not weight.is_cpu or not x.is_cpu:
        return None
    n, k = weight.shape
    if x.dtype not in _TYPES or weight.dtype not in _TYPES or x.shape[-1] != k:
        return None
    if x.dtype == torch.float32 and weight.dtype == _BF16:
        return None  # F.linear refuses this pair too
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k) if x.dim() != 2 else x  # a view for rows that are contiguous
    t = x2.shape[0]
    if t == 0 or t > MAX_ROWS or x2.stride(-1) != 1 or not weight.is_contiguous():
        return None
    if bias is not None and (
        bias.shape != (n,) or not bias.is_cpu or bias.dtype not in _TYPES
        or not bias.is_contiguous()
    ):  # fmt: skip
        return None  # F.linear then names the shapes (a wrong-sized bias is an error there)
    lib = LIBRARY.get()
    if lib is None:
        return None
    out = torch.empty(t, n, dtype=weight.dtype, device="cpu")
    args = RowsLinearArgs(
        x2.data_ptr(), x2.stride(0), weight.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), t, k, n,
        int(x.dtype == _BF16), int(weight.dtype == _BF16),
        int(bias is not None and bias.dtype == _BF16), int(weight.dtype == _BF16),
        torch.get_num_threads(),
    )  # fmt: skip
    step_graph.launch(lib.llmhal_rows_linear_call, args)
    return out.view(*lead, n)
