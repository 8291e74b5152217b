"""llmhal-rocm (work in progress: detection lands with the platform class)."""

from __future__ import annotations

from llmhal.platforms import PlatformUnavailable, called_by_llmhal, platform_probe

__version__ = "0.1.0"


@platform_probe("llmhal_rocm.platform:RocmPlatform")
def rocm_platform_plugin() -> str | None:
    if not called_by_llmhal():
        return None
    raise PlatformUnavailable("detection not implemented yet")
