"""Helpers shared by the CUDA attention backends (hardware-neutral ones live in ``llmhal.attention``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmhal.attention.utils import platform_mismatch
from llmhal.utils import imports

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.platforms import Platform


def not_installed(module: str, extra: str) -> str:
    """The availability reason for a missing optional library, naming the extra that installs it."""
    return imports.not_installed(module, f"llmhal-cuda[{extra}]")


def platform_reasons(platform: Platform) -> list[str]:
    """Reasons a CUDA backend cannot run on ``platform`` at all (it must drive NVIDIA GPUs)."""
    from llmhal_cuda.platform import CudaPlatform

    return platform_mismatch(platform, CudaPlatform)
