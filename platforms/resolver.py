"""Platform resolution: which installed platform becomes ``current_platform``.

Rules (ARCHITECTURE.md section 3):

1. ``VLLM_PLATFORM=<name>`` selects that platform: the entry point of that name, otherwise the
   platform whose ``Platform.name`` is that (``VLLM_PLATFORM=cpu`` finds entry point ``llmhal_cpu``).
   Other platform probes are not called (nor, for an entry-point name, imported).
2. Otherwise every allowed probe is called. A probe that raises counts as "not available" and the
   exception is kept as the reason (:class:`PlatformUnavailable` is the polite way to say why),
   unless ``VLLM_PLUGINS`` names the plugin: then anything but ``PlatformUnavailable`` is an error
   with the probe's message, as an import failure of a listed plugin is.
3. The class must subclass :class:`llmhal.platforms.Platform` and declare a supported
   ``PLATFORM_API_VERSION``; otherwise it is skipped with a warning that says why.
4. Among the available platforms the highest ``priority`` wins; a tie at the top is an error naming
   the contenders and the remedy.
5. None available: :class:`UnspecifiedPlatform`, whose every use names the package to install.

First-party probes call :func:`called_by_llmhal` and return None when another framework (vLLM) calls
them, and their entry points are named ``llmhal_cpu``/``llmhal_cuda``/``llmhal_rocm``, never one of
vLLM's built-in platform names: vLLM's resolver takes a plugin whose name matches an activated
built-in (``cuda`` on a GPU machine) as an activated plugin and then calls it for its class path, so a
first-party ``cuda`` entry point returning None would break vLLM in the same environment.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

from llmhal.logger import init_logger
from llmhal.platforms.interface import (
    PLATFORM_API_VERSION,
    SUPPORTED_PLATFORM_API_VERSIONS,
    Platform,
    PlatformUnavailable,
    UnspecifiedPlatform,
)

logger = init_logger(__name__)

# vLLM's built-in platform names, past and present. vLLM's resolver takes a plugin of one of these
# names as activated whenever its own built-in is; an llmhal probe returning None there breaks vLLM.
VLLM_BUILTIN_PLATFORMS = frozenset(
    {"tpu", "cuda", "rocm", "hpu", "xpu", "cpu", "neuron", "openvino"}
)

# ProbeResult.status values
SELECTED = "selected"
AVAILABLE = "available"
UNAVAILABLE = "unavailable"
REJECTED = "rejected"  # available but not an llmhal platform, or an incompatible API version
NOT_LOADED = "not loaded"  # import failed, not allowed, or skipped; see reason


class PlatformResolutionError(RuntimeError):
    """The installed platforms cannot be resolved to exactly one (the message names the remedy).

    ``probes`` holds what every probe said when resolution got that far (``llmhal doctor`` shows it).
    """

    probes: tuple[ProbeResult, ...] = ()


@dataclass(frozen=True)
class ProbeResult:
    """What one platform entry point said when probed."""

    name: str
    value: str
    distribution: str | None
    version: str | None
    status: str
    class_path: str | None = None
    priority: int | None = None
    reason: str = ""
    platform: str | None = None  # the platform's name (Platform.name), when declared or imported


@dataclass(frozen=True)
class PlatformSelection:
    """The outcome of resolution: who won, how, and what every probe said."""

    name: str  # the platform's name (Platform.name), e.g. "cpu"
    class_path: str
    selected_by: str  # "VLLM_PLATFORM", "probe" or "none"
    reason: str
    probes: tuple[ProbeResult, ...] = field(default_factory=tuple)
    entry_point: str | None = None  # the winning entry point's name, e.g. "llmhal_cpu"


_state = threading.local()


def called_by_llmhal() -> bool:
    """True while llmhal's resolver is calling probes (first-party probes return None otherwise)."""
    return getattr(_state, "probing", False)


def probing_now() -> str | None:
    """What this thread's resolver is doing right now (a probe, a class import), or None."""
    return getattr(_state, "step", None)


def _requested_platform() -> str | None:
    return (os.environ.get("VLLM_PLATFORM") or "").strip() or None


def _load_probes() -> dict[str, Any]:
    """Import the allowed platform probes; with VLLM_PLATFORM naming an entry point, only that one.

    ``VLLM_PLATFORM`` holding a platform name instead (``cpu`` for entry point ``llmhal_cpu``) needs
    the probe modules to find who declares that name; they are cheap to import by contract.
    """
    from llmhal.plugins import PLATFORM_PLUGINS_GROUP, discover, load_plugins_by_group

    requested = _requested_platform()
    by_entry = requested is not None and any(
        ep.name == requested for ep in discover(PLATFORM_PLUGINS_GROUP)
    )
    return load_plugins_by_group(
        PLATFORM_PLUGINS_GROUP,
        only=frozenset({requested}) if by_entry else None,
        skip_reason=f"VLLM_PLATFORM={requested} selects another platform",
        reraise=(PlatformResolutionError,),
    )


def _declared_name(probe: Any) -> str | None:
    name = getattr(probe, "llmhal_platform_name", None)
    return name if isinstance(name, str) and name else None


def declared_platform_classes() -> dict[str, str]:
    """Platform name -> class path declared with ``@platform_probe`` (for inactive platforms too).

    The key is the name declared with ``@platform_probe(..., name=...)``, or the entry point's name
    when none is declared. Imports only the probe modules that VLLM_PLUGINS allows (with
    VLLM_PLATFORM naming an entry point, only that one), never the platform classes.
    """
    out = {}
    for name, probe in _load_probes().items():
        path = getattr(probe, "llmhal_platform_class", None)
        if isinstance(path, str):
            out[_declared_name(probe) or name] = path
    return out


def _entries_to_probe(requested: str | None, probes: dict[str, Any]) -> set[str]:
    """The loaded probes to call: all of them, or those that may be the VLLM_PLATFORM choice.

    A probe that declares another platform name cannot be the choice and is not called; one that
    declares none is called, and its class's ``name`` decides.
    """
    if requested is None:
        return set(probes)
    if requested in probes:
        return {requested}
    declared = {n for n, p in probes.items() if _declared_name(p) == requested}
    return declared or {n for n, p in probes.items() if _declared_name(p) is None}


def _import_platform_class(path: str) -> tuple[type[Platform] | None, str]:
    """Import and vet a platform class; return (class, "") or (None, reason)."""
    from llmhal.utils.imports import resolve_obj_by_qualname

    try:
        cls = resolve_obj_by_qualname(path)
    except PlatformResolutionError:
        raise
    except Exception as e:
        return None, f"could not import {path}: {type(e).__name__}: {e}"
    if not isinstance(cls, type) or not issubclass(cls, Platform):
        return None, (
            f"{path} is not a subclass of llmhal.platforms.Platform; it probably targets another "
            f"framework (for example vLLM) and is ignored by llmhal"
        )
    version = getattr(cls, "PLATFORM_API_VERSION", None)
    if version not in SUPPORTED_PLATFORM_API_VERSIONS:
        return None, (
            f"{path} implements llmhal platform API version {version}, but this llmhal implements "
            f"version {PLATFORM_API_VERSION} (accepts {sorted(SUPPORTED_PLATFORM_API_VERSIONS)}); "
            f"install a release of the platform package built for API {PLATFORM_API_VERSION}, "
            f"or a matching llmhal"
        )
    return cls, ""


def _probe(name: str, probe: Any, record: Any) -> tuple[ProbeResult, type[Platform] | None]:
    dist, version = record.distribution, record.version
    value = record.value

    declared = _declared_name(probe)

    def result(status: str, reason: str, path: str | None = None, prio: int | None = None):
        return ProbeResult(name, value, dist, version, status, path, prio, reason, declared)

    _state.probing = True
    _state.step = f"calling the probe of platform plugin {name!r} ({value}) from {record.origin}"
    try:
        path = probe()
    except PlatformResolutionError:
        raise
    except PlatformUnavailable as e:
        return result(UNAVAILABLE, str(e) or "probe reported unavailable"), None
    except (Exception, SystemExit) as e:  # a probe calling sys.exit must not end the process
        if _explicitly_allowed(name):
            raise PlatformResolutionError(
                f"The probe of platform plugin {name!r} ({_dist(dist, version)}), which "
                f"VLLM_PLUGINS lists, raised {type(e).__name__}: {e}. A listed plugin that fails "
                f"is an error; fix or reinstall that package, or remove {name!r} from "
                f"VLLM_PLUGINS. (A probe reports a missing device by returning None or raising "
                f"llmhal.platforms.PlatformUnavailable.)"
            ) from e
        logger.info(
            "Platform probe %r raised %s: %s (treated as unavailable)", name, type(e).__name__, e
        )
        return result(UNAVAILABLE, f"probe raised {type(e).__name__}: {e}"), None
    finally:
        _state.probing = False
        _state.step = None
    if path is None:
        return result(UNAVAILABLE, "probe found no device (returned None)"), None
    if not isinstance(path, str):
        return result(REJECTED, f"probe returned {type(path).__name__}, not a class path"), None
    _state.step = f"importing {path}, the class of platform plugin {name!r} from {record.origin}"
    try:
        cls, why = _import_platform_class(path)
    finally:
        _state.step = None
    if cls is None:
        if why.startswith("could not import") and _explicitly_allowed(name):
            raise PlatformResolutionError(
                f"Platform plugin {name!r} ({_dist(dist, version)}) is listed in VLLM_PLUGINS, "
                f"but its platform class cannot be used: {why}. Fix or reinstall that package, or "
                f"remove {name!r} from VLLM_PLUGINS."
            )
        logger.warning("Platform plugin %r skipped: %s", name, why)
        return result(REJECTED, why, path), None
    res = result(AVAILABLE, "probe found a device", path, cls.priority)
    return _with_platform(res, cls), cls


def _with_platform(res: ProbeResult, cls: type[Platform]) -> ProbeResult:
    from dataclasses import replace

    return replace(res, platform=getattr(cls, "name", None) or res.platform)


def _explicitly_allowed(name: str) -> bool:
    """Whether VLLM_PLUGINS names this plugin (a failure of such a plugin is an error)."""
    from llmhal.plugins import allowed_plugins

    allowed = allowed_plugins()
    return allowed is not None and name in allowed


def _dist(dist: str | None, version: str | None) -> str:
    return f"{dist} {version}" if dist else "distribution unknown"


def _no_platform_reason(results: list[ProbeResult]) -> tuple[str, str | None]:
    """(why no platform is available, cause first and with its remedy; the remedy UnspecifiedPlatform
    adds to its errors, None for its install hint)."""
    from llmhal.plugins import PLATFORM_PLUGINS_GROUP, allowed_plugins, discover

    installed = sorted(ep.name for ep in discover(PLATFORM_PLUGINS_GROUP))
    allowed = allowed_plugins()
    if not installed:
        return "no platform package is installed (pip install llmhal[cpu])", ""
    if allowed is not None and not (set(installed) & allowed):
        raw = os.environ.get("VLLM_PLUGINS", "")
        example = ",".join([*installed, *sorted(allowed)])
        return (
            f"VLLM_PLUGINS={raw!r} allows none of the installed platform plugins "
            f"({', '.join(installed)}); platforms are plugins too, so list one as well, e.g. "
            f"VLLM_PLUGINS={example}, or unset VLLM_PLUGINS to load every plugin",
            "",
        )
    said = "; ".join(f"{r.name}: {r.reason}" for r in results) or "no probe ran"
    return f"no installed platform is available ({said})", None


def resolve() -> tuple[Platform, PlatformSelection]:
    """Run the resolution rules and instantiate the winner. Callers hold the module lock."""
    results: list[ProbeResult] = []
    try:
        return _resolve(results)
    except PlatformResolutionError as e:
        e.probes = tuple(results)
        raise


def _resolve(results: list[ProbeResult]) -> tuple[Platform, PlatformSelection]:
    from llmhal.plugins import PLATFORM_PLUGINS_GROUP, plugin_records

    requested = _requested_platform()
    probes = _load_probes()
    records = {r.name: r for r in plugin_records() if r.group == PLATFORM_PLUGINS_GROUP}
    to_probe = _entries_to_probe(requested, probes)
    for name in sorted(to_probe & VLLM_BUILTIN_PLATFORMS):
        logger.warning(
            "Platform plugin %r (%s) is named like one of vLLM's built-in platforms: with vLLM in "
            "the same environment, vLLM takes it as activated whenever its own %s platform is and "
            "then fails on the class path it returns. Its package should rename the entry point "
            "(e.g. 'acme_%s'); VLLM_PLATFORM can still select it by its platform name.",
            name,
            records[name].origin if name in records else "distribution unknown",
            name,
            name,
        )

    classes: dict[str, type[Platform]] = {}
    for name, rec in records.items():
        if name not in to_probe:
            skipped = name in probes  # loaded, but VLLM_PLATFORM chose another by name
            reason = f"VLLM_PLATFORM={requested} selects another platform" if skipped else None
            results.append(
                ProbeResult(
                    name,
                    rec.value,
                    rec.distribution,
                    rec.version,
                    NOT_LOADED,
                    None,
                    None,
                    reason or rec.reason or rec.status,
                    _declared_name(probes[name]) if skipped else None,
                )
            )
            continue
        res, cls = _probe(name, probes[name], rec)
        results.append(res)
        if cls is not None:
            classes[name] = cls

    if requested:
        return _finish_requested(requested, classes, records, results)

    if not classes:
        reason, remedy = _no_platform_reason(results)
        sel = PlatformSelection(
            UnspecifiedPlatform.name,
            "llmhal.platforms.interface:UnspecifiedPlatform",
            "none",
            reason,
            tuple(results),
        )
        logger.warning("No llmhal platform is available: %s", reason)
        return UnspecifiedPlatform(reason, remedy), sel

    best = max(c.priority for c in classes.values())
    top = [n for n, c in classes.items() if c.priority == best]
    if len(top) > 1:
        raise PlatformResolutionError(
            f"Platforms {', '.join(repr(n) for n in top)} are all available with the same priority "
            f"({best}), so llmhal cannot choose. Pick one with VLLM_PLATFORM={top[0]} (or "
            f"VLLM_PLATFORM={top[1]}), or exclude the others from VLLM_PLUGINS."
        )
    name = top[0]
    others = [f"{n} (priority {c.priority})" for n, c in classes.items() if n != name]
    why = f"highest priority ({best}) among available platforms" + (
        f"; also available: {', '.join(others)}" if others else ""
    )
    res = next(r for r in results if r.name == name)
    return _finish(classes[name], name, res, "probe", why, results, others=list(classes))


def _finish_requested(
    requested: str,
    classes: dict[str, type[Platform]],
    records: dict[str, Any],
    results: list[ProbeResult],
) -> tuple[Platform, PlatformSelection]:
    """VLLM_PLATFORM=requested: the entry point of that name, else the platform of that name."""
    from llmhal.plugins import FAILED, NOT_ALLOWED

    if requested in classes:
        matches = [requested]
    else:
        matches = [n for n, c in classes.items() if getattr(c, "name", None) == requested]
    if len(matches) > 1:
        raise PlatformResolutionError(
            f"VLLM_PLATFORM={requested!r} names the platform of several entry points "
            f"({', '.join(matches)}); set VLLM_PLATFORM to one of those entry-point names."
        )
    if matches:
        name = matches[0]
        res = next((r for r in results if r.name == name), None)
        how = f"VLLM_PLATFORM={requested}" + (f" (entry point {name})" if name != requested else "")
        return _finish(classes[name], name, res, "VLLM_PLATFORM", how, results)
    rec = records.get(requested)
    candidates = [r for r in results if r.name == requested or r.platform == requested]
    if rec is not None and rec.status == NOT_ALLOWED:
        why = f"VLLM_PLUGINS={os.environ.get('VLLM_PLUGINS')!r} does not allow it"
    elif rec is not None and rec.status == FAILED:
        why = rec.reason
    elif len(candidates) == 1:
        why = candidates[0].reason or candidates[0].status
    else:
        why = f"no installed platform plugin or platform is named {requested!r}"
    names = ", ".join(_entry_and_platform(r) for r in results) or "none"
    raise PlatformResolutionError(
        f"VLLM_PLATFORM={requested!r} was requested, but that platform is not usable: {why}. "
        f"Installed platform plugins: {names}. Unset VLLM_PLATFORM to choose automatically."
    )


def _entry_and_platform(r: ProbeResult) -> str:
    return f"{r.name} (platform {r.platform})" if r.platform and r.platform != r.name else r.name


def _finish(
    cls: type[Platform],
    name: str,
    res: ProbeResult | None,
    by: str,
    why: str,
    results: list[ProbeResult],
    others: list[str] | None = None,
):
    from dataclasses import replace

    try:
        platform = cls()
    except Exception as e:
        alternatives = [n for n in others or [] if n != name]
        if by == "VLLM_PLATFORM":
            remedy = "unset VLLM_PLATFORM to choose automatically"
        elif alternatives:
            remedy = f"choose another platform with VLLM_PLATFORM={alternatives[0]}"
        else:
            remedy = "exclude it with VLLM_PLUGINS"
        origin = _dist(res.distribution, res.version) if res else "distribution unknown"
        raise PlatformResolutionError(
            f"Platform {name!r} ({origin}) was selected by {by}, but creating it failed: "
            f"{type(e).__name__}: {e}. Fix its set-up, or {remedy}."
        ) from e
    final = [replace(r, status=SELECTED) if r.name == name else r for r in results]
    path = res.class_path if res and res.class_path else f"{cls.__module__}:{cls.__qualname__}"
    logger.info("Platform %r selected by %s: %s", platform.name, by, why)
    return platform, PlatformSelection(platform.name, path, by, why, tuple(final), name)
