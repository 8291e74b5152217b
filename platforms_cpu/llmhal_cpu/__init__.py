"""llmhal-cpu: the CPU platform. Importing this module is cheap (no torch); see ``platform.py``."""

from __future__ import annotations

from llmhal.platforms import called_by_llmhal, platform_probe

__version__ = "0.1.0"


@platform_probe("llmhal_cpu.platform:CpuPlatform", name="cpu")
def cpu_platform_plugin() -> str | None:
    """Entry point of group ``vllm.platform_plugins``: the CPU is always there.

    Returns None when another framework (vLLM) calls it, so installing llmhal beside vLLM never
    replaces vLLM's own platform.
    """
    if not called_by_llmhal():
        return None
    return "llmhal_cpu.platform:CpuPlatform"
