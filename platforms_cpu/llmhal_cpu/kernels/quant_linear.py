"""The CPU ``quant_linear`` kernel: the native ``quant_gemm`` kernel, with torch fallbacks.

:class:`CpuQuantLinear` (registered as ``quant_linear`` in ``CpuPlatform.op_kernels``) runs a
:class:`~llmhal.ops.quant_linear.GroupedQuantWeight` through, in order of preference:

1. ``cpu_qgemm`` (:mod:`.quant_gemm`): the weight repacked once, still 4/8-bit; activations quantized
   to int16 per block of 32 inputs, exact integer dot products, fp32 accumulation and output.
2. ``cpu_int4pack`` (:mod:`.int4pack`): torch's int4 matmul with bf16 activations and output, when
   the native kernel cannot be built (no compiler; said once in a log line and by :func:`status`).
3. core's exact :class:`~llmhal.ops.quant_linear.NativeQuantLinear`, for what neither takes.

Accuracy bar, on the default model (SmolLM2-135M-Instruct Q4_1, Q8_0 LM head) against the exact
path (``LLMHAL_GGUF_KERNEL=dequant``): greedy tokens equal and every top-5 log-probability within
0.01 nats, teacher-forced over 16 tokens of 4 prompts (chat "What is the capital of France?", a
642-token prefill, ...). Measured worst differences: int16 0.0025, fp32 0.0000 (both pass);
int8 activations 0.45 and int4pack 0.27 (both fail: the chat prompt answers "L'Étoile..." instead
of "Paris").

``LLMHAL_CPU_QUANT_KERNEL`` overrides the choice: ``auto`` (default), ``int16``, ``fp32`` (exact) or
``int8`` (the native kernel in that mode for every call), ``int4pack``, ``native``.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

import torch

from llmhal.logger import init_logger
from llmhal.ops.quant_linear import GroupedQuantWeight, NativeQuantLinear
from llmhal_cpu.kernels import quant_gemm
from llmhal_cpu.kernels.int4pack import Int4PackLinear

logger = init_logger(__name__)

CHOICES = ("auto", "fp32", "int16", "int8", "int4pack", "native")
_MODES = {
    "fp32": quant_gemm.MODE_FP32,
    "int16": quant_gemm.MODE_INT16,
    "int8": quant_gemm.MODE_INT8,
}
_warned = threading.Event()
MAX_SCALE_BITS = 1.0  # scale/offset bits per weight the native kernel may add (see _too_large)


def kernel_choice() -> str:
    """``LLMHAL_CPU_QUANT_KERNEL`` (read when a kernel is built); unknown values list the valid ones."""
    raw = os.environ.get("LLMHAL_CPU_QUANT_KERNEL", "auto").strip().lower() or "auto"
    if raw not in CHOICES:
        raise ValueError(
            f"LLMHAL_CPU_QUANT_KERNEL={raw!r} is not a CPU quant_linear kernel; use one of "
            f"{', '.join(CHOICES)}"
        )
    return raw


def choose_mode(bits: int, m: int) -> int:
    """The ``quant_gemm`` inner product for a call of ``m`` rows on a ``bits``-bit weight (auto).

    int16 activations for every call: measured (``llmhal.benchmarks.quant_kernels``, SmolLM2
    shapes, M = 1..512, AVX-512-VNNI and AVX2 builds, 1 and 2 threads) it is the fastest of the
    accurate options everywhere (fp32 ties it only where M=1 is memory-bound, and is 1.3-3x slower
    from M=16 on AVX-512-VNNI, 1.3-1.7x on an AVX2-only Zen 3); int8 activations and torch's
    int4pack (bf16) are faster in places but change SmolLM2's answers (see the module docstring).
    Using one mode for every M also keeps results independent of the batch: a row gives the same
    output alone or in a prefill.
    """
    return quant_gemm.MODE_INT16


def status() -> str:
    """What ``quant_linear`` runs on this host, and why (for ``llmhal doctor``)."""
    choice = kernel_choice()
    if choice in ("int4pack", "native"):
        return f"{choice} (LLMHAL_CPU_QUANT_KERNEL={choice})"
    quant_gemm.load_library()
    state = quant_gemm.kernel_status()
    if state.startswith("ok"):
        return f"cpu_qgemm {choice}: {state}"
    return f"cpu_int4pack / native: the native quant_gemm kernel is unavailable ({state})"


def _gemm_or_reason(weight: GroupedQuantWeight) -> tuple[Any, str | None]:
    lib = quant_gemm.load_library()
    if lib is None:
        reason = f"the native quant_gemm kernel is unavailable ({quant_gemm.kernel_status()})"
        if not _warned.is_set():
            _warned.set()
            logger.warning(
                "CPU quant_linear: %s; using torch's int4pack kernel (bf16 activations and "
                "output: less accurate) and core's native kernel",
                reason,
            )
        return None, reason
    reason = quant_gemm.supports(weight) or _too_large(weight)
    return (quant_gemm.QuantGemm(weight, lib), None) if reason is None else (None, reason)


def _too_large(weight: GroupedQuantWeight) -> str | None:
    """Why ``weight`` should not be repacked for size, or None.

    Scales that fp16 cannot hold exactly are stored as fp32; with small groups that would add more
    than the 1 bit per weight GGUF's own formats spend (K-quants: sub-block scales of 16 or 32
    weights, e.g. Q4_K 4.5 bits a weight in the file, 6 repacked). Those keep their previous paths
    (int4pack, or the exact per-call dequantization) and their size.
    """
    bits = quant_gemm.scale_bits_per_weight(weight)
    if bits > MAX_SCALE_BITS:
        return (
            f"its fp32 scales would add {bits:g} bits per weight (groups of {weight.group_size}; "
            f"at most {MAX_SCALE_BITS:g})"
        )
    return None


class CpuQuantLinear:
    """``y = x @ W.T + bias`` for a :class:`GroupedQuantWeight` (see the module docstring).

    Built once per weight at load; calls return ``x.dtype``. ``name`` says which path runs it.
    ``embedding(ids)`` (row lookups for quantized embedding tables) exists only where the storage
    is row-addressable (``cpu_qgemm``, native), so a tied table keeps one copy.
    """

    name = "cpu_qgemm"

    def __init__(
        self, weight: GroupedQuantWeight, act_dtype: torch.dtype, choice: str | None = None
    ) -> None:
        self.shape = weight.shape
        self.bits = weight.bits
        self.group_size = weight.group_size
        self.act_dtype = act_dtype
        self.choice = choice or kernel_choice()
        if self.choice not in CHOICES:
            raise ValueError(f"choice {self.choice!r} is not one of {', '.join(CHOICES)}")
        self._gemm: quant_gemm.QuantGemm | None = None
        self._fallback: Any = None
        reason = f"LLMHAL_CPU_QUANT_KERNEL={self.choice}"
        if self.choice in _MODES or self.choice == "auto":
            self._gemm, reason = _gemm_or_reason(weight)
        if self._gemm is not None:
            if self.choice != "auto":
                self.name = f"cpu_qgemm ({self.choice})"
            self.embedding = self._embedding
            return
        if self.choice != "native" and Int4PackLinear.supports(weight, act_dtype) is None:
            self._fallback = Int4PackLinear(weight, act_dtype)
        else:
            self._fallback = NativeQuantLinear(weight, act_dtype)
            self.embedding = self._fallback.embedding
        self.name = f"{self._fallback.name} ({reason})"

    @classmethod
    def status(cls) -> str:
        """Which path runs on this host and why (``llmhal doctor`` shows it beside the op)."""
        return status()

    @classmethod
    def benchmark_variants(cls) -> dict[str, Any]:
        """Name -> constructor ``(weight, act_dtype)`` of each path, for ``llmhal bench quant_kernels``."""
        return {
            f"cpu:{c}": functools.partial(cls, choice=c)
            for c in ("fp32", "int16", "int8", "int4pack")
        }

    @classmethod
    def supports(cls, weight: GroupedQuantWeight, act_dtype: torch.dtype) -> str | None:
        """None when a fast path runs ``weight``; otherwise why not (it is then delegated)."""
        choice = kernel_choice()
        if choice == "native":
            return "LLMHAL_CPU_QUANT_KERNEL=native"
        if choice != "int4pack" and quant_gemm.load_library() is not None:
            reason = quant_gemm.supports(weight) or _too_large(weight)
            if reason is None:
                return None
            return None if Int4PackLinear.supports(weight, act_dtype) is None else reason
        return Int4PackLinear.supports(weight, act_dtype)

    def weight_bytes(self) -> int:
        impl = self._gemm if self._gemm is not None else self._fallback
        return impl.weight_bytes()

    def dequantize(self) -> torch.Tensor:
        """The weight as the kernel sees it, float32 ``[N, K]``."""
        if self._gemm is None:
            return self._fallback.dequantize()
        return self._gemm.rows(torch.arange(self.shape[0]))

    def _embedding(self, ids: torch.Tensor) -> torch.Tensor:
        assert self._gemm is not None
        rows = self._gemm.rows(ids.reshape(-1))
        return rows.to(self.act_dtype).view(*ids.shape, self.shape[1])

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._gemm is None:
            return self._fallback(x, bias)
        if self.choice == "auto":
            mode = choose_mode(self.bits, x.numel() // self.shape[1])
        else:
            mode = _MODES[self.choice]
        return self._gemm(x, bias, mode)
