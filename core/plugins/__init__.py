"""Plugin discovery and loading through entry points.

Groups (the names are vLLM's, so vendors who know vLLM feel at home):

``vllm.general_plugins``
    a zero-arg callable, called once per process by :func:`load_general_plugins`, or an object
    (usually a module) holding pluggy hook implementations of :mod:`llmhal.plugins.hookspecs`.
``vllm.platform_plugins``
    a zero-arg probe returning a platform class path or ``None``; loaded on first access of
    ``llmhal.platforms.current_platform``.
``vllm.io_processor_plugins``
    a zero-arg callable returning an IOProcessor class path or ``None``; process 0, when requested.
``vllm.stat_logger_plugins``
    a ``StatLoggerBase`` subclass; process 0, at engine start.

``VLLM_PLUGINS`` is an allow-list and a security boundary: unset loads everything, ``""`` loads nothing,
otherwise only the listed entry-point names (whitespace stripped) are imported. A plugin that is not
allowed is never imported. A plugin whose distribution targets vLLM rather than llmhal (see
:mod:`llmhal.plugins.foreign`) is skipped, with one INFO line, unless ``VLLM_PLUGINS`` names it. Every
discovered entry point gets a :class:`PluginRecord`, which ``llmhal doctor`` shows. A plugin that
fails is logged once with its distribution and version; if the user named it in ``VLLM_PLUGINS`` the
failure is raised as :class:`PluginLoadError`.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from llmhal.logger import init_logger
from llmhal.plugins.foreign import TARGETS_VLLM, is_missing_vllm, targets_vllm_reason

if TYPE_CHECKING:  # pragma: no cover
    from importlib.metadata import EntryPoint

logger = init_logger(__name__)

GENERAL_PLUGINS_GROUP = "vllm.general_plugins"
PLATFORM_PLUGINS_GROUP = "vllm.platform_plugins"
IO_PROCESSOR_PLUGINS_GROUP = "vllm.io_processor_plugins"
STAT_LOGGER_PLUGINS_GROUP = "vllm.stat_logger_plugins"
GROUPS = (
    GENERAL_PLUGINS_GROUP,
    PLATFORM_PLUGINS_GROUP,
    IO_PROCESSOR_PLUGINS_GROUP,
    STAT_LOGGER_PLUGINS_GROUP,
)

# PluginRecord.status values
DISCOVERED = "discovered"  # found, not loaded yet (nothing asked for this group)
LOADED = "loaded"
FAILED = "failed"
NOT_ALLOWED = "not allowed"  # filtered out by VLLM_PLUGINS
SKIPPED = "skipped"  # not needed, e.g. another platform was chosen with VLLM_PLATFORM
# TARGETS_VLLM ("targets vLLM"): written for vLLM, skipped unless VLLM_PLUGINS names it


class PluginLoadError(RuntimeError):
    """A plugin the user asked for explicitly (in ``VLLM_PLUGINS``) failed to load or run."""


@dataclass(frozen=True)
class PluginRecord:
    """What happened to one discovered entry point."""

    group: str
    name: str
    value: str
    distribution: str | None
    version: str | None
    status: str
    reason: str = ""

    @property
    def origin(self) -> str:
        return _origin(self.distribution, self.version)


def _origin(distribution: str | None, version: str | None) -> str:
    if distribution is None:
        return "unknown distribution"
    return f"{distribution} {version or '?'}"


_lock = threading.RLock()
_records: dict[tuple[str, str], PluginRecord] = {}
_loaded: dict[tuple[str, str], Any] = {}
_warned_unknown: set[str] = set()
_warned_conflicts: set[tuple[str, str]] = set()
_foreign_noted = False
_foreign: dict[tuple[str, str], str | None] = {}  # (group, name) -> targets_vllm_reason, memoized
_FOREIGN_REMEDY = "name it in VLLM_PLUGINS to load it anyway"
_general_lock = threading.RLock()
_general_loaded = False
# The plugin being imported by this thread, for diagnostics of re-entrant access (see loading_now).
_state = threading.local()


def allowed_plugins() -> frozenset[str] | None:
    """Parse ``VLLM_PLUGINS``: None = no filter; an empty set = load nothing."""
    raw = os.environ.get("VLLM_PLUGINS")
    if raw is None:
        return None
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


def discover(group: str) -> list[EntryPoint]:
    """The entry points of ``group``, in discovery order, without importing any of them.

    The same entry point seen twice (a distribution on ``sys.path`` twice) counts once. Two different
    entry points with the same name in one group are a conflict: the first found wins and a warning
    names both, since ``VLLM_PLUGINS`` and ``VLLM_PLATFORM`` select plugins by name.
    """
    from importlib.metadata import entry_points

    seen: dict[str, EntryPoint] = {}
    out = []
    for ep in entry_points(group=group):
        first = seen.get(ep.name)
        if first is None:
            seen[ep.name] = ep
            out.append(ep)
        elif first.value != ep.value and (group, ep.name) not in _warned_conflicts:
            _warned_conflicts.add((group, ep.name))
            logger.warning(
                "Two plugins are named %r in group %s: %s from %s and %s from %s; using the first. "
                "Uninstall one of them.",
                ep.name,
                group,
                first.value,
                _origin(*_dist_of(first)),
                ep.value,
                _origin(*_dist_of(ep)),
            )
    return out


def _dist_of(ep: EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    try:
        return dist.metadata["Name"], dist.version
    except Exception:  # broken metadata must not break discovery
        return None, None


def _record(ep: EntryPoint, group: str, status: str, reason: str = "") -> PluginRecord:
    dist, version = _dist_of(ep)
    rec = PluginRecord(group, ep.name, ep.value, dist, version, status, reason)
    _records[(group, ep.name)] = rec
    return rec


def _warn_unknown_names(allowed: frozenset[str]) -> None:
    """Warn once per name in VLLM_PLUGINS that matches no entry point in any group."""
    known = {ep.name for g in GROUPS for ep in discover(g)}
    for name in sorted(allowed - known - _warned_unknown):
        _warned_unknown.add(name)
        # "cpu" for "llmhal_cpu": the first-party entry points avoid vLLM's built-in names.
        close = sorted(k for k in known if k.endswith(f"_{name}"))
        hint = f" (did you mean {' or '.join(repr(k) for k in close)}?)" if close else ""
        logger.warning(
            "VLLM_PLUGINS requested %r, but no installed plugin has that name%s. Installed "
            "plugins: %s",
            name,
            hint,
            ", ".join(sorted(known)) or "none",
        )


def _note_foreign_plugins() -> None:
    """Once per process: one INFO line naming every installed plugin that targets vLLM."""
    global _foreign_noted
    if _foreign_noted or allowed_plugins() is not None:
        return
    _foreign_noted = True
    from importlib.metadata import entry_points

    # One scan of every distribution for all groups (a scan per group costs ~40 ms each).
    eps = entry_points()
    found = sorted(
        {
            f"{ep.name} ({why.removesuffix(f'; {_FOREIGN_REMEDY}')})"
            for g in GROUPS
            for ep in eps.select(group=g)
            if (why := _foreign_reason(ep, None))
        }
    )
    if found:
        logger.info(
            "Skipping %d plugin(s) written for vLLM, not llmhal: %s. Name one in VLLM_PLUGINS to "
            "load it anyway.",
            len(found),
            "; ".join(found),
        )


def _foreign_reason(ep: EntryPoint, allowed: frozenset[str] | None) -> str | None:
    """Why ``ep`` is skipped as a vLLM plugin, or None (always None when VLLM_PLUGINS is set: a
    listed plugin is loaded whatever it targets, and an unlisted one is not allowed anyway)."""
    if allowed is not None:
        return None
    key = (ep.group, ep.name)
    if key not in _foreign:  # reading METADATA costs ~20 ms a distribution
        _foreign[key] = targets_vllm_reason(ep)
    why = _foreign[key]
    return f"{why}; {_FOREIGN_REMEDY}" if why else None


def load_plugins_by_group(
    group: str,
    *,
    only: frozenset[str] | None = None,
    skip_reason: str = "not requested",
    reraise: tuple[type[BaseException], ...] = (),
) -> dict[str, Any]:
    """Import the allowed entry points of ``group`` and return ``{name: loaded object}``.

    Idempotent and thread-safe: each entry point is imported at most once per process, and later
    calls return the cached objects. ``only`` narrows further (``VLLM_PLATFORM`` uses it); entry
    points outside it are recorded as skipped with ``skip_reason`` and not imported.

    An import failure is recorded and logged once, and the plugin is not retried in this process.
    It raises :class:`PluginLoadError` when the plugin is named in ``VLLM_PLUGINS``; an exception of
    a type in ``reraise`` is recorded and then propagates unchanged (rule violations that must stop
    the caller rather than just disable the plugin).
    """
    if group not in GROUPS:
        raise ValueError(f"unknown plugin group {group!r}; known groups: {', '.join(GROUPS)}")
    allowed = allowed_plugins()
    out: dict[str, Any] = {}
    with _lock:
        if allowed:
            _warn_unknown_names(allowed)
        _note_foreign_plugins()
        for ep in discover(group):
            key = (group, ep.name)
            if key in _loaded:
                out[ep.name] = _loaded[key]
                continue
            if allowed is not None and ep.name not in allowed:
                _record(ep, group, NOT_ALLOWED, "not listed in VLLM_PLUGINS")
                continue
            foreign = _foreign_reason(ep, allowed)
            if foreign:
                _record(ep, group, TARGETS_VLLM, foreign)
                continue
            prev = _records.get(key)
            if prev is not None and prev.status == FAILED:
                continue  # logged once already; never retried in this process
            if only is not None and ep.name not in only:
                _record(ep, group, SKIPPED, skip_reason)
                continue
            _state.loading = (group, ep.name, ep.value, _origin(*_dist_of(ep)))
            try:
                obj = ep.load()
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt):
                    raise
                explicit = allowed is not None and ep.name in allowed
                if not explicit and is_missing_vllm(e):
                    why = f"imports {e.name}, which is not installed: written for vLLM"  # type: ignore[attr-defined]
                    _record(ep, group, TARGETS_VLLM, f"{why}; {_FOREIGN_REMEDY}")
                    logger.info("Plugin %r (%s) skipped: %s", ep.name, _origin(*_dist_of(ep)), why)
                    continue
                rec = _record(ep, group, FAILED, f"import failed: {type(e).__name__}: {e}")
                if isinstance(e, reraise):
                    raise
                _report_failure(rec, e, explicit=explicit)
                continue
            finally:
                _state.loading = None
            _loaded[key] = obj
            _record(ep, group, LOADED)
            out[ep.name] = obj
            logger.debug("Loaded plugin %s = %s (%s)", ep.name, ep.value, _records[key].origin)
    return out


def loading_now() -> str | None:
    """A description of the plugin this thread is importing right now, or None (diagnostics)."""
    current = getattr(_state, "loading", None)
    if current is None:
        return None
    group, name, value, origin = current
    return f"importing plugin {name!r} ({value}, group {group}) from {origin}"


def _report_failure(rec: PluginRecord, exc: BaseException, *, explicit: bool) -> None:
    msg = f"Plugin {rec.name!r} ({rec.value}) from {rec.origin} failed: {rec.reason.rstrip('.')}"
    if explicit:
        raise PluginLoadError(
            f"{msg}. It is listed in VLLM_PLUGINS, so this is an error; fix or uninstall the "
            f"plugin, or remove it from VLLM_PLUGINS."
        ) from exc
    logger.error("%s. Run `llmhal doctor` for details.", msg, exc_info=exc)


def mark_failed(group: str, name: str, reason: str, exc: BaseException | None = None) -> None:
    """Record that a loaded plugin failed when used (a general plugin or one of its hooks raised).

    Logs the failure, or raises :class:`PluginLoadError` when ``VLLM_PLUGINS`` names the plugin.
    """
    with _lock:
        prev = _records.get((group, name))
        if prev is None:
            return
        rec = replace(prev, status=FAILED, reason=reason)
        _records[(group, name)] = rec
    allowed = allowed_plugins()
    if exc is not None:
        _report_failure(rec, exc, explicit=allowed is not None and name in allowed)


def plugin_records(*, discover_all: bool = True) -> list[PluginRecord]:
    """Every discovered entry point of every group, with its status, in group order."""
    with _lock:
        if discover_all:
            for group in GROUPS:
                for ep in discover(group):
                    if (group, ep.name) not in _records:
                        allowed = allowed_plugins()
                        if allowed is not None and ep.name not in allowed:
                            _record(ep, group, NOT_ALLOWED, "not listed in VLLM_PLUGINS")
                        elif foreign := _foreign_reason(ep, allowed):
                            _record(ep, group, TARGETS_VLLM, foreign)
                        else:
                            _record(ep, group, DISCOVERED)
        order = {g: i for i, g in enumerate(GROUPS)}
        return sorted(_records.values(), key=lambda r: (order.get(r.group, 99), r.name))


def load_general_plugins() -> None:
    """Load and run every allowed general plugin, once per process (thread-safe).

    The flag is set before running, so a plugin that fails is not retried in this process; a
    second thread waits until the first has finished instead of running the plugins again. The
    plugins run outside the registry lock, so they may resolve ``current_platform`` or look up
    other plugins.
    """
    global _general_loaded
    with _general_lock:
        if _general_loaded:
            return
        _general_loaded = True
        plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
        from llmhal.plugins.hooks import run_general_plugins

        run_general_plugins(plugins)


def _reset_for_tests() -> None:
    """Forget everything loaded (tests only; plugins' side effects are not undone)."""
    global _general_loaded, _foreign_noted
    with _general_lock, _lock:
        _records.clear()
        _loaded.clear()
        _warned_unknown.clear()
        _warned_conflicts.clear()
        _general_loaded = False
        _foreign_noted = False
        _foreign.clear()
