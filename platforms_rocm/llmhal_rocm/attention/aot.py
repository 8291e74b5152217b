"""Compiling ``rocm_attn``'s Triton kernels for a GPU architecture without a GPU.

Triton's HIP backend (LLVM's AMDGPU target, shipped inside the ``triton`` wheel) compiles on any
host, so a kernel that a given ``gfx`` arch would refuse is caught here, before a first decode step
fails on the device. :func:`compile_launch` compiles one :class:`~.paged_decode.KernelLaunch` with
the argument types and constants :func:`~.paged_decode.decode_launches` chose for real tensors;
:func:`compile_paged_decode` does it for a representative decode step.
"""

from __future__ import annotations

from typing import Any

import torch

from llmhal_rocm.attention.paged_decode import KernelLaunch, decode_launches

# Triton's names for the element types of pointer arguments.
_POINTER_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
    torch.float8_e4m3fnuz: "fp8e4b8",
    torch.float8_e5m2fnuz: "fp8e5b16",
}
# Archs the project checks: CDNA2 (MI200), CDNA3 (MI300), CDNA4 (MI350), RDNA3, RDNA4.
CHECKED_ARCHS = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1201")


def _arg_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a kernel argument of type {type(value).__name__}")


def wavefront_size(arch: str) -> int:
    """64 on CDNA (gfx9), 32 on RDNA (gfx10+)."""
    return 64 if arch.startswith("gfx9") else 32


def gpu_target(arch: str) -> Any:
    """Triton's target for ``"gfx942"`` (HIP) or ``"sm_90"`` (CUDA: the kernel also runs on NVIDIA
    GPUs, and ptxas ships with Triton, so that compile runs on a CPU too)."""
    from triton.backends.compiler import GPUTarget

    if arch.startswith("sm_"):
        return GPUTarget("cuda", int(arch[3:]), 32)
    return GPUTarget("hip", arch, wavefront_size(arch))


def compile_launch(launch: KernelLaunch, arch: str) -> Any:
    """Compile ``launch``'s kernel for ``arch`` (see :func:`gpu_target`); returns the compiled
    kernel (``.asm["amdgcn"]`` or ``.asm["ptx"]`` holds the assembly). Raises Triton's
    CompilationError when the arch refuses the kernel."""
    import triton
    from triton.compiler import ASTSource

    fn = launch.kernel
    if not hasattr(fn, "arg_names"):
        raise RuntimeError(
            "the kernel is interpreted (TRITON_INTERPRET=1 was set when it was imported) and "
            "cannot be compiled"
        )
    signature = {
        name: "constexpr" if name in launch.constexprs else _arg_type(launch.args[name])
        for name in fn.arg_names
    }
    source = ASTSource(fn, signature, constexprs=dict(launch.constexprs))
    return triton.compile(source, target=gpu_target(arch))


def example_launches(
    dtype: torch.dtype,
    *,
    kv_dtype: torch.dtype | None = None,
    head_size: int = 128,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    block_size: int = 16,
    sliding_window: int | None = 64,
    logits_soft_cap: float | None = 30.0,
) -> list[KernelLaunch]:
    """The launches of a small decode step (two requests) in ``dtype``, built on the CPU."""
    kv_dtype = kv_dtype or dtype
    blocks = 8
    q = torch.zeros(2, num_heads, head_size, dtype=dtype)
    cache = torch.zeros(2, blocks, block_size, num_kv_heads, head_size).to(kv_dtype)
    table = torch.arange(2 * 4, dtype=torch.int32).reshape(2, 4)
    seq_lens = torch.tensor([33, 50], dtype=torch.int32)
    one = torch.ones((), dtype=torch.float32)
    _, launches = decode_launches(
        q, cache, table, seq_lens, 50, head_size**-0.5, one, one,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, interpreted=False,
    )  # fmt: skip
    return launches


def compile_paged_decode(arch: str, dtype: torch.dtype, **kw: Any) -> list[Any]:
    """Compile the split and merge kernels of :func:`example_launches` for ``arch``."""
    return [compile_launch(launch, arch) for launch in example_launches(dtype, **kw)]
