"""Platforms: the ``Platform`` contract and the lazily resolved ``current_platform``.

``from llmhal.platforms import Platform`` is cheap and never triggers resolution, so a vendor's probe
module can subclass it. The first access of ``llmhal.platforms.current_platform`` resolves the platform
once per process, under a lock (see :mod:`llmhal.platforms.resolver` for the rules). Touching
``current_platform`` while platform plugins are being discovered (from a probe, or a platform module's
import) raises :class:`PlatformResolutionError` and shows who touched it.

A resolution that fails is remembered: later accesses, from any thread, raise the same error without
calling the probes again (8 threads starting an engine run each probe once).

Code inside llmhal reads the platform through :func:`get_current_platform` at the moment of use, so a
test may swap it with :func:`set_current_platform` (which also forgets a remembered failure).
"""

from __future__ import annotations

import threading
import traceback
from typing import TYPE_CHECKING, Any

from llmhal.platforms.accelerator import AcceleratorPlatform
from llmhal.platforms.interface import (
    PLATFORM_API_VERSION,
    DeviceCapability,
    Platform,
    PlatformCapabilities,
    PlatformNotUsableError,
    PlatformUnavailable,
    StepGraph,
    UnspecifiedPlatform,
    platform_probe,
)

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.platforms.resolver import PlatformSelection

__all__ = [
    "PLATFORM_API_VERSION",
    "AcceleratorPlatform",
    "DeviceCapability",
    "Platform",
    "PlatformCapabilities",
    "PlatformNotUsableError",
    "PlatformResolutionError",
    "PlatformUnavailable",
    "StepGraph",
    "UnspecifiedPlatform",
    "called_by_llmhal",
    "current_platform",
    "get_current_platform",
    "get_platform_selection",
    "platform_probe",
    "set_current_platform",
]

_lock = threading.RLock()
_platform: Platform | None = None
_selection: PlatformSelection | None = None
_failure: Exception | None = None  # why the last resolution failed, re-raised until reset
_failure_tb: Any = None  # its traceback as first raised: each re-raise starts from it again
_resolving_thread: int | None = None
_init_trace = ""  # the stack of the first access, for "who resolved the platform?" questions


def called_by_llmhal() -> bool:
    """True while llmhal's resolver calls probes; first-party probes return None otherwise."""
    from llmhal.platforms.resolver import called_by_llmhal as _called

    return _called()


def get_current_platform() -> Platform:
    """Resolve (once) and return the active platform."""
    global _platform, _selection, _resolving_thread, _init_trace, _failure, _failure_tb
    if _platform is not None:
        return _platform
    from llmhal.platforms.resolver import resolve

    if _resolving_thread == threading.get_ident():
        raise _reentrant_access_error()
    with _lock:
        if _platform is not None:
            return _platform
        if _failure is not None:
            # Raising the same object again would append this access's frames to its traceback
            # every time (it grew by two frames per access).
            raise _failure.with_traceback(_failure_tb)
        _resolving_thread = threading.get_ident()
        try:
            _init_trace = "".join(traceback.format_stack())
            platform, selection = resolve()
        except Exception as e:
            _failure, _failure_tb = e, e.__traceback__
            raise
        finally:
            _resolving_thread = None
        _selection = selection
        _platform = platform
        return platform


def _reentrant_access_error() -> Exception:
    from llmhal.platforms.resolver import PlatformResolutionError, probing_now
    from llmhal.plugins import loading_now

    during = loading_now() or probing_now() or "platform plugins were being discovered"
    who = "".join(traceback.format_stack(limit=14)[:-2])
    return PlatformResolutionError(
        f"llmhal.platforms.current_platform was accessed while {during}, before any "
        f"platform exists. A platform probe or platform module must not touch current_platform at "
        f"import time or inside its probe; read it later (inside methods) or use the Platform "
        f"class itself. Fix the plugin, or exclude it with VLLM_PLUGINS. Accessed from:\n{who}"
    )


def get_platform_selection() -> PlatformSelection:
    """How the current platform was chosen (resolves it if needed)."""
    get_current_platform()
    assert _selection is not None
    return _selection


def set_current_platform(
    platform: Platform | None, selection: PlatformSelection | None = None
) -> None:
    """Replace the active platform (tests, embedding applications). None forgets it, so the next
    access resolves again."""
    global _platform, _selection, _failure
    from llmhal.platforms.resolver import PlatformSelection as _Sel

    with _lock:
        _platform = platform
        _failure = None
        if platform is not None and selection is None:
            cls = type(platform)
            selection = _Sel(
                platform.name,
                f"{cls.__module__}:{cls.__qualname__}",
                "set_current_platform",
                "set explicitly",
            )
        _selection = selection


def __getattr__(name: str) -> Any:
    if name == "current_platform":
        return get_current_platform()
    if name == "PlatformResolutionError":
        from llmhal.platforms.resolver import PlatformResolutionError

        return PlatformResolutionError
    raise AttributeError(f"module 'llmhal.platforms' has no attribute {name!r}")
