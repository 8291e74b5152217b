"""Choosing the attention backend for a layer configuration.

1. An explicit choice (the engine config's ``attention_backend``, else ``VLLM_ATTENTION_BACKEND``) is
   validated and used. If it is unknown, provided by another platform, or invalid for the
   configuration, :class:`AttentionBackendError` lists the reasons and the backends that would work
   here. It is never silently replaced.
2. Otherwise the layer's kind narrows the candidates, and the platform's priority list for this
   configuration is walked; the first backend whose ``validate`` is empty wins. If none is valid, one
   error lists every candidate with its reasons.

Each distinct selection is logged once and remembered for ``llmhal doctor``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from llmhal.attention.registry import (
    BackendEntry,
    is_usable_provider,
    list_attention_backends,
    load_backend_class,
    normalize,
)
from llmhal.logger import init_logger

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.attention.backend import AttentionBackend, AttentionRequirements
    from llmhal.platforms import Platform

logger = init_logger(__name__)


class AttentionBackendError(ValueError):
    """No usable attention backend for the request; the message lists reasons and alternatives."""


@dataclass(frozen=True)
class AttentionSelection:
    name: str
    backend: type[AttentionBackend]
    selected_by: str  # "config", "VLLM_ATTENTION_BACKEND" or "priority"
    reason: str
    requirements: AttentionRequirements
    rejected: tuple[tuple[str, tuple[str, ...]], ...] = ()


_lock = threading.Lock()
_selections: dict[tuple, AttentionSelection] = {}


def recent_selections() -> list[AttentionSelection]:
    with _lock:
        return list(_selections.values())


def backend_reasons(
    entry: BackendEntry, requirements: AttentionRequirements, platform: Platform
) -> list[str]:
    """Why ``entry`` cannot serve ``requirements`` on ``platform`` (empty = usable)."""
    if not is_usable_provider(entry):
        return [_inactive_platform_reason(entry.provider)]
    try:
        cls = load_backend_class(entry)
    except Exception as e:
        return [f"cannot import {entry.class_path}: {type(e).__name__}: {e}"]
    return cls.validate(requirements, platform)


def _inactive_platform_reason(provider: str) -> str:
    from llmhal.platforms import get_platform_selection

    for p in get_platform_selection().probes:
        if provider in (p.platform, p.name):  # the platform's name, or its entry point's
            return inactive_provider_message(provider, p.status, p.reason)
    return inactive_provider_message(provider, None, "")


def inactive_provider_message(provider: str, status: str | None, reason: str) -> str:
    """Why a contribution of a platform other than the active one cannot be used; when that
    platform's probe found its device, how to select it (status None: not installed)."""
    why = "not installed" if status is None else f"{status}: {reason}" if reason else status
    message = f"provided by the {provider} platform, which is not active here ({why})"
    if status == "available":
        message += f"; VLLM_PLATFORM={provider} selects that platform"
    return message


def _with_capability(
    requirements: AttentionRequirements, platform: Platform
) -> AttentionRequirements:
    if requirements.device_capability is not None:
        return requirements
    cap = platform.device_capability()
    return replace(requirements, device_capability=tuple(cap) if cap else None)


def _usable_alternatives(
    requirements: AttentionRequirements, platform: Platform, skip: str
) -> list[str]:
    out = []
    for e in list_attention_backends():
        if e.name != skip and not backend_reasons(e, requirements, platform):
            out.append(e.name)
    return out


def select_attention_backend(
    requirements: AttentionRequirements,
    explicit: str | None = None,
    platform: Platform | None = None,
    *,
    ignore_explicit: bool = False,
) -> AttentionSelection:
    """Pick the backend for ``requirements`` (see the module docstring for the rules).

    ``ignore_explicit``: select by priority even when ``VLLM_ATTENTION_BACKEND`` is set (a hybrid
    model's layers of another kind than the chosen backend's; see :mod:`llmhal.attention.state`).
    """
    from llmhal.platforms import get_current_platform

    platform = platform or get_current_platform()
    req = _with_capability(requirements, platform)
    env = None if ignore_explicit else os.environ.get("VLLM_ATTENTION_BACKEND", "").strip() or None
    if explicit and env and normalize(explicit) != normalize(env):
        logger.warning(
            "attention_backend=%r from the engine config overrides VLLM_ATTENTION_BACKEND=%r",
            explicit,
            env,
        )
    choice, source = (explicit, "config") if explicit else (env, "VLLM_ATTENTION_BACKEND")
    key = (req, normalize(choice) if choice else None, platform.name)
    with _lock:
        if key in _selections:
            return _selections[key]
    sel = (
        _select_explicit(choice, source, req, platform)
        if choice
        else _select_by_priority(req, platform)
    )
    with _lock:
        if key not in _selections:
            logger.info(
                "Attention backend %s selected by %s: %s", sel.name, sel.selected_by, sel.reason
            )
        _selections[key] = sel
    return sel


def _select_explicit(
    choice: str, source: str, req: AttentionRequirements, platform: Platform
) -> AttentionSelection:
    name = normalize(choice)
    entries = {e.name: e for e in list_attention_backends()}
    origin = "attention_backend=" if source == "config" else "VLLM_ATTENTION_BACKEND="
    entry = entries.get(name)
    if entry is None:
        reasons = [f"unknown backend; known backends: {', '.join(sorted(entries))}"]
    else:
        reasons = backend_reasons(entry, req, platform)
    if reasons:
        alternatives = _usable_alternatives(req, platform, skip=name)
        raise AttentionBackendError(
            f"Attention backend {choice!r} ({origin}{choice}) cannot be used on the {platform.name} "
            f"platform for this model ({req.describe()}):\n"
            + "".join(f"  - {r}\n" for r in reasons)
            + f"Backends that work here: {', '.join(alternatives) or 'none'}. "
            + (
                "Choose one of them, or unset the choice to select automatically."
                if alternatives
                else ""
            )
        )
    assert entry is not None
    cls = load_backend_class(entry)
    return AttentionSelection(name, cls, source, f"{origin}{choice}", req)


def _candidates(req: AttentionRequirements, platform: Platform) -> list[BackendEntry]:
    entries = {e.name: e for e in list_attention_backends()}
    ordered = [normalize(n) for n in platform.attention_backend_priority(req)]
    seen = set(ordered)
    # Backends of other kinds that the platform does not rank (e.g. a plugin's Mamba backend),
    # core's hardware-neutral ones last: a platform's or a plugin's own comes first.
    if req.kind != "mha":
        unranked = [e for n, e in entries.items() if n not in seen and e.kind == req.kind]
        ordered += [e.name for e in sorted(unranked, key=lambda e: e.is_core)]
    out = []
    for n in ordered:
        e = entries.get(n)
        if e is None:
            logger.debug("Platform %s ranks unknown attention backend %r", platform.name, n)
            continue
        if e.kind is not None and e.kind != req.kind:
            continue
        out.append(e)
    return out


def _select_by_priority(req: AttentionRequirements, platform: Platform) -> AttentionSelection:
    rejected: list[tuple[str, tuple[str, ...]]] = []
    for e in _candidates(req, platform):
        reasons = backend_reasons(e, req, platform)
        if not reasons:
            cls = load_backend_class(e)
            why = f"first valid backend in the {platform.name} platform's priority list"
            if rejected:
                why += "; skipped " + "; ".join(f"{n} ({', '.join(r)})" for n, r in rejected)
            return AttentionSelection(e.name, cls, "priority", why, req, tuple(rejected))
        rejected.append((e.name, tuple(reasons)))
    raise AttentionBackendError(
        f"No attention backend on the {platform.name} platform can serve this model ({req.describe()}):\n"
        + "".join(f"  - {n}: {'; '.join(r)}\n" for n, r in rejected)
        + (
            "Install a platform package whose backends support it, or change the model's dtype or "
            "kv_cache_dtype."
        )
    )


def _clear_cache_for_tests() -> None:
    with _lock:
        _selections.clear()
