"""Helpers shared by the CUDA attention backends (hardware-neutral ones live in ``llmhal.attention``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmhal.attention.utils import platform_mismatch

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.platforms import Platform


def platform_reasons(platform: Platform) -> list[str]:
    """Reasons a CUDA backend cannot run on ``platform`` at all (it must drive NVIDIA GPUs)."""
    from llmhal_cuda.platform import CudaPlatform

    return platform_mismatch(platform, CudaPlatform)
