"""The native routed-experts kernel (``moe_experts.cpp``): loading and the call.

:func:`moe_experts` takes a layer's routing (expert ids and weights per token, from
``select_experts``) and its stacked expert weights, and returns the weighted sum of the chosen
experts' gated MLPs in float32, or None when the call is not one the kernel takes (a dtype or
layout it does not read, the library unavailable), so :mod:`llmhal_cpu.moe` falls back to core's
grouped torch path. Built on first use by :mod:`llmhal_cpu.native_build`;
``LLMHAL_CPU_MOE_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from llmhal_cpu import native_build

SOURCE = Path(__file__).with_name("moe_experts.cpp")
# The weight types the kernel reads (moe_experts.cpp's WeightType).
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
ACTIVATION_TYPES = (torch.float32, torch.bfloat16)

_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


def _setup(lib: ctypes.CDLL) -> None:
    fn = lib.llmhal_moe_experts
    fn.argtypes = [_p, _p, _p, _i64, _i32, _p, _p, _p, _p, _i32, _i64, _i64, _i64, _p, _i32]
    fn.restype = ctypes.c_int


LIBRARY = native_build.KernelLibrary(
    SOURCE, "moe_experts", _setup, disable_env="LLMHAL_CPU_MOE_KERNEL"
)


def status() -> str:
    """``"native"`` or why core's torch path runs (for ``llmhal doctor``)."""
    if LIBRARY.disabled():
        return "torch (LLMHAL_CPU_MOE_KERNEL=0)"
    return "native moe_experts" if LIBRARY.get() else f"torch ({LIBRARY.status})"


def _host(x: torch.Tensor) -> bool:
    return x.is_cpu and x.is_contiguous()


def moe_experts(
    hidden: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``sum_k weights[:, k] * w2[e_k] @ silu(gate) * up`` in float32 [T, H], or None.

    ``hidden`` [T, H] float32 or bfloat16; ``weights`` float32 / ``ids`` int64 [T, k];
    ``w13`` [E, 2I, H] and ``w2`` [E, H, I] float32, bfloat16, or int8 with float32 row scales
    ``w13_scale`` [E, 2I] / ``w2_scale`` [E, H].
    """
    wtype = WEIGHT_TYPES.get(w13.dtype)
    if wtype is None or w2.dtype != w13.dtype or hidden.dtype not in ACTIVATION_TYPES:
        return None
    int8 = w13.dtype == torch.int8
    if int8 != (w13_scale is not None and w2_scale is not None):
        return None
    e, two_i, h = w13.shape
    if hidden.dim() != 2 or hidden.shape[1] != h or w2.shape != (e, h, two_i // 2):
        return None
    if not (_host(w13) and _host(w2) and hidden.is_cpu):
        return None
    lib = LIBRARY.get()  # reads LLMHAL_CPU_MOE_KERNEL each call: ~1 us against a layer's ~1 ms
    if lib is None:
        return None
    scales: list[torch.Tensor | None] = [None, None]
    if int8:
        scales = [s.float().contiguous() for s in (w13_scale, w2_scale)]  # type: ignore[union-attr]
    x = hidden.float().contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.float().contiguous()
    t, k = ids.shape
    out = torch.empty(t, h, dtype=torch.float32)
    rc = lib.llmhal_moe_experts(
        x.data_ptr(), ids.data_ptr(), weights.data_ptr(), t, k, w13.data_ptr(), w2.data_ptr(),
        None if scales[0] is None else scales[0].data_ptr(),
        None if scales[1] is None else scales[1].data_ptr(),
        wtype, e, h, two_i // 2, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise IndexError(f"fused_moe: an expert id is outside 0..{e - 1}")
    return out
