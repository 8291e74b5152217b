"""llmhal-cuda: the NVIDIA GPU platform. Importing this module is cheap (no torch, no NVML)."""

from __future__ import annotations

import os

from llmhal.platforms import PlatformUnavailable, called_by_llmhal, platform_probe

__version__ = "0.1.0"


@platform_probe("llmhal_cuda.platform:CudaPlatform", name="cuda")
def cuda_platform_plugin() -> str | None:
    """Entry point of group ``vllm.platform_plugins``: available when NVML sees a visible GPU.

    Returns None when another framework (vLLM) calls it, so installing llmhal beside vLLM never
    replaces vLLM's own platform. Raises :class:`PlatformUnavailable` with the reason otherwise
    (shown by ``llmhal doctor``). Never creates a CUDA context.
    """
    if not called_by_llmhal():
        return None
    from llmhal_cuda import visibility
    from llmhal_cuda.detect import NVML, detect_cuda

    inventory = detect_cuda()
    if inventory.source == NVML:
        value = os.environ.get(visibility.ENV_VAR)
        if not visibility.visible_indices(value, inventory.devices):
            raise PlatformUnavailable(
                f"{visibility.ENV_VAR}={value!r} hides all {len(inventory.devices)} NVIDIA GPU(s)"
            )
    return "llmhal_cuda.platform:CudaPlatform"
