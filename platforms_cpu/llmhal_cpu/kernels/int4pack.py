"""torch's int4 weight-only matmul with bf16 activations: the CPU ``quant_linear`` fallback.

Weights are repacked once, at load, for ``aten._weight_int4pack_mm_for_cpu``, whose dequantization is
``w = (q - 8) * scale + zero`` per group along K. The normalised form ``w = s * q + offset`` maps onto
it with ``scale = s`` and ``zero = offset + 8 s`` (Q4_0: zero = 0; Q4_1: zero = m + 8 d).

8-bit codes (Q8_0, and Q5_0/Q5_1/Q5_K through their 8-bit form) are split into two 4-bit planes,
``q = lo + 16 * hi`` with ``lo = q & 15`` and ``hi = q >> 4`` (arithmetic). The planes are laid side
by side along K, so one call with the activation repeated twice computes
``x @ (s*lo + offset)^T + x @ (16 s * hi)^T``; the lo plane's groups take ``(s, offset + 8 s)``, the hi
plane's ``(16 s, 0)`` with codes ``hi + 8``. The int8 matmul torch offers on CPU
(``_weight_int8pack_mm``) takes only one scale per output channel, which per-block formats do not map
onto without re-quantizing.

Precision: the op needs its scales in the activation dtype, and its float32-activation path is
~30x slower than the bf16 one, so activations, scales and zeros are rounded to bf16 for the call
(llama.cpp likewise rounds activations to 8 bits). The output is then bf16 too, so rounding the
scales adds an error of the same order as the activation/output rounding that a bf16 model has
anyway; ``LLMHAL_GGUF_KERNEL=dequant`` (GGUF) or :class:`NativeQuantLinear` is the exact path.
Measured numbers are in ``llmhal.benchmarks.quant_kernels``.

:class:`~llmhal_cpu.kernels.quant_linear.CpuQuantLinear` uses it only when the native
``quant_gemm`` kernel cannot be built (or ``LLMHAL_CPU_QUANT_KERNEL=int4pack``). Weights this kernel
cannot run (group size other than 32/64/128/256, N not a multiple of 16, a
torch without the op) are delegated to core's :class:`NativeQuantLinear`; so are 8-bit codes when
torch's CPU kernels run below AVX-512 (``torch.backends.cpu.get_cpu_capability()``), where the
two planes measured no faster than the exact native kernel.
"""

from __future__ import annotations

import torch

from llmhal.ops.quant_linear import GroupedQuantWeight, NativeQuantLinear

_GROUP_SIZES = (32, 64, 128, 256)
_PACK_ROWS = 4096  # rows repacked at a time: bounds the int32 staging copy; a multiple of 64


def _has_int4pack() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(
        ops, "_convert_weight_to_int4pack_for_cpu"
    )


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 ``[N, K]`` -> the op's packed layout (row blocks of 64 pack independently)."""
    n = codes.shape[0]
    step = _PACK_ROWS if n % 64 == 0 else n
    parts = [
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes[s : s + step].to(torch.int32).contiguous(), 1
        )
        for s in range(0, n, step)
    ]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class Int4PackLinear:
    """``y = x @ W.T + bias`` for a :class:`GroupedQuantWeight`, kept packed (see module docstring).

    Built once per weight at load; the call runs in bf16 and returns ``x.dtype``. A weight it cannot
    run is handed to :class:`NativeQuantLinear` (``name`` then says ``native`` and why).
    """

    name = "cpu_int4pack"
    compute_dtype = torch.bfloat16

    def __init__(self, weight: GroupedQuantWeight, act_dtype: torch.dtype) -> None:
        self.shape = weight.shape
        self.bits = weight.bits
        self.group_size = weight.group_size
        self.act_dtype = act_dtype
        reason = self.supports(weight, act_dtype)
        self._native: NativeQuantLinear | None = None
        if reason is not None:
            self._native = NativeQuantLinear(weight, act_dtype)
            self.name = f"native ({reason})"
            # Row lookups only where the storage is row-addressable (the int4pack layout is not).
            self.embedding = self._native.embedding
            return
        s = weight.scale.to(torch.float32)
        off = torch.zeros_like(s) if weight.offset is None else weight.offset.to(torch.float32)
        q = weight.qweight
        if weight.bits == 4:
            codes, scale, zero = q, s, off + 8 * s
        else:
            q8 = q.to(torch.int8)
            lo = (q8 & 15).to(torch.uint8)
            hi = ((q8 >> 4) + 8).to(torch.uint8)
            codes = torch.cat([lo, hi], dim=1)
            scale = torch.cat([s, 16 * s], dim=1)
            zero = torch.cat([off + 8 * s, torch.zeros_like(s)], dim=1)
        self.packed = _pack(codes)
        # [groups, N, 2]: the op's scale-and-zero layout
        self.scale_zero = (
            torch.stack([scale.t(), zero.t()], dim=-1).to(self.compute_dtype).contiguous()
        )

    @classmethod
    def supports(cls, weight: GroupedQuantWeight, act_dtype: torch.dtype) -> str | None:
        """None when the int4 path can run ``weight``; otherwise why not (it is then delegated)."""
        if not _has_int4pack():
            return (
                f"torch {torch.__version__} has no aten._weight_int4pack_mm_for_cpu (needs >= 2.6)"
            )
        n, _ = weight.shape
        if weight.group_size not in _GROUP_SIZES:
            return f"group size {weight.group_size} is not one of {_GROUP_SIZES}"
        if n % 16:
            return f"N={n} is not a multiple of 16"
        if weight.bits == 8 and not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
            # Two 4-bit planes double the work; measured on AVX2 this is no faster than the exact
            # native kernel at M=1 and slower at M=16 (see llmhal.benchmarks.quant_kernels).
            cap = torch.backends.cpu.get_cpu_capability()
            return f"8-bit codes run as two 4-bit planes only with AVX-512 (torch uses {cap})"
        return None

    def weight_bytes(self) -> int:
        if self._native is not None:
            return self._native.weight_bytes()
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale_zero))

    def dequantize(self) -> torch.Tensor:
        """The weight as the kernel sees it (bf16-rounded scales), float32 ``[N, K]``."""
        if self._native is not None:
            return self._native.dequantize()
        k = self.shape[1]
        eye = torch.eye(k, dtype=self.compute_dtype)
        return self._mm(eye).t().to(torch.float32).contiguous()

    def _mm(self, x2d: torch.Tensor) -> torch.Tensor:
        xb = x2d.to(self.compute_dtype)
        if self.bits == 8:
            xb = torch.cat([xb, xb], dim=-1)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            xb.contiguous(), self.packed, self.group_size, self.scale_zero
        )

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._native is not None:
            return self._native(x, bias)
        n, k = self.shape
        y = self._mm(x.reshape(-1, k)).to(x.dtype).view(*x.shape[:-1], n)
        if bias is not None:
            y = y + bias.to(x.dtype)
        return y
