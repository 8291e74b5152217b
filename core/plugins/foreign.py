"""Plugins written for vLLM, found in the same entry-point groups as llmhal's own.

llmhal reads vLLM's group names, so every vLLM plugin installed in the environment shows up too. Run
unasked, such a plugin imports vLLM (or fails to, with a traceback, when vLLM is absent) and registers
things with vLLM, not llmhal. So llmhal skips a plugin whose distribution *targets vLLM* unless the
user names it in ``VLLM_PLUGINS``:

- its distribution does not name ``llmhal`` among its requirements (extras included: a package that
  serves both frameworks says so by naming llmhal anywhere), and
- it requires ``vllm`` (outside an extra), or its distribution's name starts with ``vllm`` (vLLM's own
  plugins and test packages, e.g. ``vllm-ascend``, ``vllm_add_dummy_model``, often leave the
  requirement out so that installing them does not reinstall vLLM).

A plugin that matched neither rule and then fails to import because ``vllm`` is missing is reported
the same way (one INFO line, no traceback), since that failure says it was written for vLLM.

Deciding reads only distribution metadata: no plugin module is imported to decide.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from importlib.metadata import EntryPoint

TARGETS_VLLM = "targets vLLM"  # PluginRecord.status of a skipped vLLM plugin

_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _metadata(ep: EntryPoint) -> tuple[str | None, list[str]]:
    """(distribution name, its requirement lines) of the entry point, parsing METADATA once."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, []
    try:
        md = dist.metadata  # parsed on every access, so once here
        reqs = md.get_all("Requires-Dist")
        if reqs is None:  # an egg-info install keeps them in requires.txt
            reqs = dist.requires or []
        return md["Name"], list(reqs)
    except Exception:  # broken metadata: decide nothing from it
        return None, []


def _requirements(lines: list[str]) -> list[tuple[str, bool]]:
    """(normalized name, only under an extra) for each requirement line."""
    out = []
    for req in lines:
        m = _NAME.match(req)
        if m:
            out.append((_normalize(m.group(1)), "extra" in req.partition(";")[2]))
    return out


def targets_vllm_reason(ep: EntryPoint) -> str | None:
    """Why the entry point's distribution targets vLLM rather than llmhal, or None if it does not."""
    dist_name, lines = _metadata(ep)
    reqs = _requirements(lines)
    if any(name == "llmhal" for name, _ in reqs):
        return None
    label = dist_name or "its distribution"
    if any(name == "vllm" and not extra for name, extra in reqs):
        return f"{label} requires vllm and not llmhal"
    if dist_name and _normalize(dist_name).startswith("vllm"):
        return f"{label} is named as a vLLM plugin and does not require llmhal"
    return None


def is_missing_vllm(exc: BaseException) -> bool:
    """Whether an import failure is ``vllm`` (or a submodule of it) not being installed."""
    name = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    return isinstance(name, str) and (name == "vllm" or name.startswith("vllm."))
