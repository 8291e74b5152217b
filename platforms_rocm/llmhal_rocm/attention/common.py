"""Helpers shared by the ROCm attention backends (hardware-neutral ones live in ``llmhal.attention``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmhal.attention.utils import platform_mismatch
from llmhal.utils import imports

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.platforms import Platform
    from llmhal_rocm.platform import RocmPlatform


def not_installed(module: str, extra: str) -> str:
    """The availability reason for a missing optional library, naming the extra that installs it."""
    return imports.not_installed(module, f"llmhal-rocm[{extra}]")


def rocm_platform(platform: Platform) -> tuple[RocmPlatform | None, list[str]]:
    """(``platform``, []) if it drives AMD GPUs, else (None, the availability reason saying so)."""
    from llmhal_rocm.platform import RocmPlatform

    if isinstance(platform, RocmPlatform):
        return platform, []
    return None, platform_mismatch(platform, RocmPlatform)
