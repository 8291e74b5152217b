"""Whether the GPU libraries the CUDA backends call are really usable, and why not.

``find_spec`` finds an import name, not an API: flash-attn-4 installs a namespace ``flash_attn``
(``flash_attn.cute``) without FlashAttention 2's ``flash_attn_varlen_func``; a flash-attn or
FBGEMM wheel built for another torch fails to load its library; ``fbgemm-gpu`` without the GenAI
build has no fp8 GEMMs. Each of those used to look available and fail on the first forward. These
checks import the library and look up the entry points llmhal calls (the names in
:mod:`llmhal_cuda.upstream_api`); each returns None when usable, else the reason ``llmhal doctor``
shows.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata

from llmhal.utils.imports import api_missing, is_available, not_installed

FA_EXTRA = "llmhal-cuda[flash-attn]"
FLASHINFER_EXTRA = "llmhal-cuda[flashinfer]"
# FlashMLA is not on PyPI under a stable name: its README builds it from source.
FLASHMLA_PACKAGE = "flash-mla (build github.com/deepseek-ai/FlashMLA: pip install -v .)"
FBGEMM_PACKAGE = "fbgemm-gpu-genai"
FBGEMM_OPS = ("quantize_fp8_per_row", "f8f8bf16_rowwise")
# FBGEMM's published pairing of its releases with torch releases (major.minor). Each wheel's
# library links against one torch; another torch fails to load it, or crashes.
FBGEMM_TORCH = {
    "1.0": "2.5",
    "1.1": "2.6",
    "1.2": "2.7",
    "1.3": "2.8",
    "1.4": "2.9",
    "1.5": "2.10",
    "1.6": "2.11",
    "1.7": "2.12",
    "1.8": "2.13",
}
FBGEMM_DISTRIBUTIONS = (
    "fbgemm-gpu-genai",
    "fbgemm-gpu",
    "fbgemm-gpu-genai-nightly",
    "fbgemm-gpu-nightly",
)


def flash_attn2_reason() -> str | None:
    """Why FlashAttention 2 (``flash_attn.flash_attn_varlen_func``) cannot be called."""
    reason = api_missing("flash_attn", ("flash_attn_varlen_func",), FA_EXTRA)
    if reason and "namespace package" in reason:
        reason += (
            "; flash-attn-4 installs only flash_attn.cute there, and llmhal calls FlashAttention "
            "2 (pip install 'flash-attn>=2.6,<3')"
        )
    return reason


def flash_attn3_reason() -> str | None:
    """Why FlashAttention 3 (``flash_attn_interface.flash_attn_with_kvcache``, the hopper/ build)
    cannot be called."""
    return api_missing(
        "flash_attn_interface",
        ("flash_attn_with_kvcache",),
        "flash-attn 3 (built from flash-attention's hopper/ folder)",
    )


def flashinfer_reason() -> str | None:
    """Why FlashInfer's paged decode/prefill wrappers cannot be used."""
    return api_missing(
        "flashinfer",
        ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"),
        FLASHINFER_EXTRA,
    )


@functools.cache
def flashinfer_moe_reason() -> str | None:
    """Why FlashInfer's CUTLASS fused-MoE kernel (``flashinfer.fused_moe.cutlass_fused_moe``)
    cannot be called (the CUDA ``fused_moe`` op then runs core's grouped implementation). Cached:
    the op asks on every call, and without FlashInfer each answer searched sys.path (~30 us, a
    MoE layer's every step)."""
    return api_missing("flashinfer.fused_moe", ("cutlass_fused_moe",), FLASHINFER_EXTRA)


def flashmla_reason() -> str | None:
    """Why FlashMLA's decode kernel (``flash_mla.flash_mla_with_kvcache``) cannot be called."""
    return api_missing(
        "flash_mla", ("get_mla_metadata", "flash_mla_with_kvcache"), FLASHMLA_PACKAGE
    )


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def fbgemm_distribution() -> tuple[str, str] | None:
    """(distribution, version) of the installed FBGEMM GPU wheel, read without importing it."""
    for dist in FBGEMM_DISTRIBUTIONS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.cache
def fbgemm_genai_reason() -> str | None:
    """Why FBGEMM's GenAI fp8 ops (``torch.ops.fbgemm.quantize_fp8_per_row`` and
    ``f8f8bf16_rowwise``) cannot be called. The torch pairing is checked before anything is
    imported: a library built for another torch may crash the process when it loads."""
    import torch

    if not is_available("fbgemm_gpu"):
        return not_installed("fbgemm_gpu", FBGEMM_PACKAGE)
    found = fbgemm_distribution()
    have = _major_minor(torch.__version__)
    if found is not None:
        dist, version = found
        paired = FBGEMM_TORCH.get(_major_minor(version))
        if paired is not None and paired != have:
            return (
                f"{dist} {version} is built for torch {paired}, this is torch "
                f"{torch.__version__}: its library would not load (install the {FBGEMM_PACKAGE} "
                f"release paired with torch {have}, or torch {paired})"
            )
    try:
        importlib.import_module("fbgemm_gpu.experimental.gen_ai")
    except Exception as e:
        what = f"{found[0]} {found[1]}" if found else "fbgemm_gpu"
        return (
            f"{what} has no usable GenAI ops (importing fbgemm_gpu.experimental.gen_ai: "
            f"{type(e).__name__}: {e}); pip install {FBGEMM_PACKAGE}"
        )
    missing = [op for op in FBGEMM_OPS if not hasattr(torch.ops.fbgemm, op)]
    if missing:
        return (
            f"fbgemm_gpu registers no torch.ops.fbgemm.{', '.join(missing)} "
            f"(pip install {FBGEMM_PACKAGE})"
        )
    return None


def summary() -> dict[str, str]:
    """Each library the CUDA kernels use and "usable" or why not (``llmhal doctor --json`` shows it
    under the platform's device: fbgemm_fp8 falls back to ``torch._scaled_mm`` without FBGEMM, so
    its reason appears nowhere else)."""
    checks = {
        "flash_attn (flash_attn backend, FA2)": flash_attn2_reason,
        "flash_attn_interface (flash_attn backend, FA3)": flash_attn3_reason,
        "flashinfer (flashinfer backend)": flashinfer_reason,
        "flashinfer.fused_moe (fused_moe op)": flashinfer_moe_reason,
        "flash_mla (flashmla backend)": flashmla_reason,
        "fbgemm_gpu (fbgemm_fp8's rowwise GEMM)": fbgemm_genai_reason,
    }
    return {name: check() or "usable" for name, check in checks.items()}
