"""Whether AMD's aiter is really what ``import aiter`` finds, and can be called.

The import name ``aiter`` belongs to two distributions: AMD's kernels (``amd-aiter``, built from
ROCm/aiter) and PyPI's ``aiter``, an unrelated helper for asynchronous iterators. Finding the name
is therefore not enough: the check imports it and looks up the entry point ``rocm_aiter_fa`` calls
(see :mod:`llmhal_rocm.upstream_api`), and names the distribution that owns the name when it is
the wrong one. None means usable; otherwise the reason ``llmhal doctor`` shows.
"""

from __future__ import annotations

import importlib.metadata

from llmhal.utils.imports import api_missing

AITER_PACKAGE = "llmhal-rocm[aiter]"
AITER_DISTRIBUTION = "amd-aiter"


def aiter_owners() -> list[str]:
    """The installed distributions that provide the top-level import name ``aiter``."""
    return sorted(set(importlib.metadata.packages_distributions().get("aiter", [])))


def aiter_reason() -> str | None:
    """Why AMD aiter's ``flash_attn_varlen_func`` cannot be called."""
    reason = api_missing("aiter", ("flash_attn_varlen_func",), AITER_PACKAGE)
    if reason is None or "not installed" in reason:
        return reason
    others = [d for d in aiter_owners() if d.lower() != AITER_DISTRIBUTION]
    if others:
        reason += (
            f"; 'aiter' here comes from {', '.join(others)} (PyPI's 'aiter' is an unrelated "
            f"asyncio package): pip uninstall {' '.join(others)} && pip install {AITER_DISTRIBUTION}"
        )
    return reason
