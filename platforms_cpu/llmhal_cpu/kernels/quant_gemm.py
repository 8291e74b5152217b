"""The native grouped-quantized matmul (``quant_gemm.cpp``): packing, loading and calls.

:class:`QuantGemm` repacks a :class:`~llmhal.ops.quant_linear.GroupedQuantWeight` once into the
kernel's layout (still 4 or 8 bits per weight, plus scales/offsets: fp16 where that is exact, else
fp32) and runs ``y = x @ W.T (+ bias)`` in one of three modes (details in the C++ header):

* ``MODE_FP32``: codes converted to float, the exact fp32 weight ``s * q + o``, fp32 FMAs;
* ``MODE_INT16``: activations quantized to int16 per 32 (or 16) inputs, exact integer dot products
  per block, fp32 accumulation across blocks (relative error ~2e-5);
* ``MODE_INT8``: the same with int8 activations (llama.cpp's scheme; relative error ~5e-3).

Which mode a call uses is the caller's choice (``kernels/quant_linear.py`` decides). The packed
layout is row-addressable, so :meth:`QuantGemm.rows` serves a tied embedding table from the same
storage.

The library is built on first use by :mod:`llmhal_cpu.native_build`; :func:`load_library` returns
None when it cannot be (no compiler, a failed build) and :func:`kernel_status` says why.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from llmhal.ops.quant_linear import GroupedQuantWeight
from llmhal.utils.openmp import threads_park_quickly
from llmhal_cpu import native_build, step_graph
from llmhal_cpu.hugepages import HugePageArena

SOURCE = Path(__file__).with_name("quant_gemm.cpp")
MODE_FP32, MODE_INT8, MODE_INT16 = 0, 1, 2
# Below this many multiply-adds a call runs on one thread (waking the team costs more). Threads
# that spin long wake in about a microsecond; parked ones (llmhal's short default spin, or PASSIVE)
# in tens, and a region needing both threads stalls whenever one core is taken. So then a batch-1
# decode keeps its GEMVs (<= 2M multiply-adds for SmolLM2's layers) on one thread and only the head
# and batched calls split: with a busy core 101 instead of 48 tok/s, quiet 102 instead of 117
# (2 cores; see llmhal.utils.openmp).
MIN_PARALLEL_WORK = (1 << 22) if threads_park_quickly() else (1 << 16)
# Where packed weights and scales live (see llmhal_cpu.hugepages).
WEIGHT_ARENA = HugePageArena()
_X_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_Y_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class WeightDesc(ctypes.Structure):
    """Mirror of ``Weight`` in quant_gemm.cpp (checked against its ``sizeof`` on load)."""

    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("kpad", ctypes.c_int64),
        ("bits", ctypes.c_int32),
        ("group_size", ctypes.c_int32),
        ("groups", ctypes.c_int32),
        ("has_offset", ctypes.c_int32),
        ("unit", ctypes.c_int32),
        ("half_scales", ctypes.c_int32),
    ]


class QgemmArgs(ctypes.Structure):
    """Mirror of ``QgemmArgs`` in quant_gemm.cpp: one call's arguments (see step_graph.py)."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("m", ctypes.c_int64),
        ("x_s", ctypes.c_int64),
        ("y", ctypes.c_void_p),
        ("y_s", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
        ("min_parallel", ctypes.c_int64),
        ("x_dtype", ctypes.c_int32),
        ("y_dtype", ctypes.c_int32),
        ("mode", ctypes.c_int32),
        ("threads", ctypes.c_int32),
    ]


class RowsArgs(ctypes.Structure):
    """Mirror of ``RowsArgs`` in quant_gemm.cpp (exact row lookups)."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("ids", ctypes.c_void_p),
        ("count", ctypes.c_int64),
        ("out", ctypes.c_void_p),
    ]


def _setup(lib: ctypes.CDLL) -> None:
    lib.llmhal_qgemm_isa.restype = ctypes.c_char_p
    for size_fn in (
        lib.llmhal_qgemm_weight_size,
        lib.llmhal_qgemm_args_size,
        lib.llmhal_qgemm_rows_args_size,
    ):
        size_fn.restype = ctypes.c_int64
    native_build.declare_struct_calls(
        lib,
        ("llmhal_qgemm_call", "llmhal_qgemm_rows_call"),
        {
            WeightDesc: lib.llmhal_qgemm_weight_size(),
            QgemmArgs: lib.llmhal_qgemm_args_size(),
            RowsArgs: lib.llmhal_qgemm_rows_args_size(),
        },
    )


LIBRARY = native_build.KernelLibrary(SOURCE, "quant_gemm", _setup)


def load_library() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None when it cannot be used (see kernel_status)."""
    return LIBRARY.get()


def kernel_status() -> str:
    """``"ok (<isa>)"``, ``"not built yet"``, or why the kernel cannot be used."""
    if LIBRARY.status is None:
        return "not built yet"
    if LIBRARY.lib is None:
        return LIBRARY.status
    return f"ok ({isa()})"


def isa() -> str:
    """The code path the library was compiled with: avx512_vnni, avx2_vnni, avx2 or scalar."""
    lib = load_library()
    return "unavailable" if lib is None else lib.llmhal_qgemm_isa().decode()


def unit_for(weight: GroupedQuantWeight) -> int | None:
    """The K block (16 or 32) the kernel uses for ``weight``, or None when it has none."""
    groups = weight.shape[1] // weight.group_size
    if groups == 1 or weight.group_size % 32 == 0:
        return 32
    if weight.group_size % 16 == 0:
        return 16
    return None


def half_scales_exact(weight: GroupedQuantWeight) -> bool:
    """True when fp16 holds every scale and offset exactly (the kernel then stores fp16)."""
    parts = [weight.scale] + ([] if weight.offset is None else [weight.offset])
    return all(bool(torch.equal(p.half().float(), p.float())) for p in parts)


def scale_bits_per_weight(weight: GroupedQuantWeight) -> float:
    """Bits the kernel's scales (and offsets) add to each weight."""
    parts = 1 + (weight.offset is not None)
    return parts * (16 if half_scales_exact(weight) else 32) / weight.group_size


def supports(weight: GroupedQuantWeight) -> str | None:
    """None when the kernel can run ``weight``; otherwise why not."""
    if unit_for(weight) is None:
        return (
            f"group size {weight.group_size} is neither a multiple of 16 nor the whole row "
            f"(K={weight.shape[1]})"
        )
    return None


class QuantGemm:
    """One packed weight and the calls on it (see the module docstring).

    ``lib`` is the loaded library (:func:`load_library`); the weight must pass :func:`supports`.
    """

    def __init__(self, weight: GroupedQuantWeight, lib: ctypes.CDLL) -> None:
        n, k = weight.shape
        unit = unit_for(weight)
        if unit is None:
            raise ValueError(supports(weight))
        self.lib = lib
        self.shape = (n, k)
        self.bits = weight.bits
        self.group_size = weight.group_size
        self.groups = k // weight.group_size
        self.kpad = -(-k // unit) * unit
        blocks = -(-n // 32) * 2  # the kernel's register tiles span up to 2 blocks of 16
        q = torch.zeros(blocks * 16, self.kpad, dtype=torch.uint8)
        q[:n, :k] = weight.qweight.view(torch.uint8)  # int8 codes keep their two's-complement bits
        if weight.bits == 4:
            v = q.view(blocks, 16, self.kpad // 8, 2, 4)
            q = v[:, :, :, 0, :] | (v[:, :, :, 1, :] << 4)
        else:
            q = q.view(blocks, 16, self.kpad // 4, 4)
        # [blocks, chunks, 16 lanes, 4 bytes], on huge pages (streamed whole by every call)
        self.packed = WEIGHT_ARENA.place(q.permute(0, 2, 1, 3))
        parts = [weight.scale] + ([] if weight.offset is None else [weight.offset])
        sc = torch.zeros(blocks * 16, self.groups, len(parts), dtype=torch.float32)
        sc[:n] = torch.stack([p.to(torch.float32) for p in parts], dim=-1)
        # fp16 where that loses nothing (GGUF stores fp16 scales): less memory to stream per call
        half = half_scales_exact(weight)
        sc = sc.half() if half else sc
        sc = sc.view(blocks, 16, self.groups, len(parts)).permute(0, 2, 3, 1)
        self.scales = WEIGHT_ARENA.place(sc)
        self.has_offset = weight.offset is not None
        self.desc = WeightDesc(
            packed=self.packed.data_ptr(),
            scales=self.scales.data_ptr(),
            n=n,
            k=k,
            kpad=self.kpad,
            bits=weight.bits,
            group_size=weight.group_size,
            groups=self.groups,
            has_offset=int(self.has_offset),
            unit=unit,
            half_scales=int(half),
        )
        self._desc_ptr = ctypes.addressof(self.desc)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The exact fp32 weight rows ``ids`` (1-D int64), ``[len(ids), K]``: what
        ``GroupedQuantWeight.dequantize()`` gives for them (one native call; a token's embedding
        through torch indexing and dequantization took ~0.35 ms of a decode step)."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), self.shape[1], dtype=torch.float32)
        args = RowsArgs(self._desc_ptr, ids.data_ptr(), ids.numel(), out.data_ptr())
        if step_graph.launch(self.lib.llmhal_qgemm_rows_call, args) != 0:
            raise IndexError(f"row ids must be in [0, {self.shape[0]}), got {ids.tolist()}")
        return out

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, mode: int = MODE_FP32
    ) -> torch.Tensor:
        """``x @ W.T + bias`` in ``x.dtype`` (fp32 accumulation; see the module docstring)."""
        n, k = self.shape
        # Each tensor call costs ~0.7 us and a decode step makes ~120 of these calls: 2-D inputs
        # in fp32/bf16 skip the reshapes and conversions.
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        if x2.dtype not in _X_DTYPES:
            x2 = x2.to(torch.float32)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        y_dtype = x2.dtype if x2.dtype in _Y_DTYPES else torch.float32
        y = torch.empty(m, n, dtype=y_dtype)
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.to(torch.float32).contiguous()
        args = QgemmArgs(
            self._desc_ptr,
            x2.data_ptr(),
            m,
            x2.stride(0),
            y.data_ptr(),
            n,
            None if bias is None else bias.data_ptr(),
            MIN_PARALLEL_WORK,
            _X_DTYPES[x2.dtype],
            _Y_DTYPES[y_dtype],
            mode,
            torch.get_num_threads(),
        )
        rc = step_graph.launch(self.lib.llmhal_qgemm_call, args)
        if rc != 0:
            raise RuntimeError(f"quant_gemm rejected its arguments (mode {mode}, x {x2.dtype})")
        if y_dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
