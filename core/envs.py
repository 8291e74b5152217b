"""Environment variables read by llmhal, in one place so ``llmhal doctor`` can show them.

The vLLM names are kept on purpose: vendors and users who know vLLM know these. Each entry says what it
means; values are read at the moment of use, never cached at import.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VARS: dict[str, str] = {
    "VLLM_PLUGINS": "comma-separated allow-list of plugin entry-point names; unset = all, '' = none",
    "VLLM_PLATFORM": "platform to use, by entry-point name (llmhal_cpu) or platform name (cpu); "
    "no other platform probe runs",
    "VLLM_ATTENTION_BACKEND": "attention backend to use (validated, never silently replaced)",
    "LLMHAL_LOGGING_LEVEL": "log level of the 'llmhal' logger (default WARNING)",
    "LLMHAL_MODEL": "model used by the CLI when --model is not given",
    "LLMHAL_GGUF_KERNEL": "GGUF matmul kernel: 'auto' (packed where exact), 'dequant' (reference)",
    "LLMHAL_NUM_THREADS": "torch intra-op threads on the CPU platform (default: all cores)",
    "LLMHAL_FP8_DEQUANT": "fp8 weights where fp8 matmuls are unavailable: 'call' (default: keep fp8, "
    "convert per call) or 'load' (convert once at load: faster, 2-4x the weight memory)",
    "LLMHAL_CPU_COMPILE": "'1' lets the CPU platform torch.compile its custom ops (default off)",
    "LLMHAL_FLEX_COMPILE": "flex_attention: 'auto' (compile where the platform supports torch.compile), '1', '0' (eager)",
    "TRITON_INTERPRET": "'1' runs Triton kernels in the interpreter (CPU testing)",
    "OMP_WAIT_POLICY": "OpenMP idle threads: PASSIVE (sleep) or ACTIVE (spin: fastest on a "
    "dedicated machine, collapses when the cores are shared); unset: llmhal's short spin",
    "GOMP_SPINCOUNT": "libgomp spin count; llmhal sets 2000 unless a wait policy was chosen",
    "LLMHAL_CACHE_DIR": "where llmhal keeps what it builds once: compiled kernels, GGUF files' "
    "converted tokenizers (default $XDG_CACHE_HOME/llmhal, else ~/.cache/llmhal)",
    "CUDA_VISIBLE_DEVICES": "devices visible to the CUDA platform",
    "HIP_VISIBLE_DEVICES": "devices visible to the ROCm platform",
}


def cache_root() -> Path:
    """LLMHAL_CACHE_DIR, else $XDG_CACHE_HOME/llmhal, else ~/.cache/llmhal (it may not exist or be
    writable yet: every user of it falls back to not caching)."""
    root = os.environ.get("LLMHAL_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmhal"


def get(name: str) -> str | None:
    """The raw value of a known variable, or None when unset."""
    if name not in ENV_VARS:
        raise KeyError(
            f"{name} is not an llmhal environment variable; known: {', '.join(ENV_VARS)}"
        )
    return os.environ.get(name)


def in_effect() -> dict[str, str]:
    """The known variables that are set, plus any other ``LLMHAL_*``/``VLLM_*`` variable."""
    out = {k: v for k, v in os.environ.items() if k in ENV_VARS}
    out.update({k: v for k, v in os.environ.items() if k.startswith(("LLMHAL_", "VLLM_"))})
    return dict(sorted(out.items()))
