"""llmhal-rocm: the AMD GPU platform. Importing this module is cheap (no torch, no amdsmi)."""

from __future__ import annotations

from llmhal.platforms import PlatformUnavailable, called_by_llmhal, platform_probe

__version__ = "0.1.0"


@platform_probe("llmhal_rocm.platform:RocmPlatform", name="rocm")
def rocm_platform_plugin() -> str | None:
    """Entry point of group ``vllm.platform_plugins``: available when amdsmi sees a visible GPU.

    Returns None when another framework (vLLM) calls it. Raises :class:`PlatformUnavailable` with
    the reason otherwise (shown by ``llmhal doctor``). Never initialises HIP.
    """
    if not called_by_llmhal():
        return None
    from llmhal_rocm import visibility
    from llmhal_rocm.detect import detect_rocm

    inventory = detect_rocm()
    try:
        visible = visibility.visible_devices(inventory.devices)
    except ValueError as e:
        raise PlatformUnavailable(str(e)) from None
    if not visible:
        raise PlatformUnavailable(
            f"{visibility.ROCR_VAR}/{visibility.ENV_VAR} hide all "
            f"{len(inventory.devices)} AMD GPU(s)"
        )
    return "llmhal_rocm.platform:RocmPlatform"
