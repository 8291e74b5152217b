"""Run plugin discovery and platform resolution again inside one test process, then put things back.

:func:`fresh_plugin_state` forgets every loaded plugin, the resolved platform and the registrations
plugins make (attention backends, quantization methods, op kernels, models), so a test can put a
throwaway distribution on ``sys.path`` and resolve again. On exit it restores the previous plugin
records and platform, drops the registrations made inside, and unloads modules imported from the
throwaway folders, so later tests see the session as it was.

:func:`switched_platform` is the light version: it lets a test make platform instances it built
(fakes of any vendor's platform) current, and restores the resolved one on exit.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.platforms import Platform

P = TypeVar("P", bound="Platform")


def _clear_registries() -> None:
    from llmhal.attention import registry as attention_registry
    from llmhal.attention import selector
    from llmhal.models.registry import ModelRegistry
    from llmhal.ops import registry as ops_registry
    from llmhal.quantization import registry as quant_registry

    attention_registry._clear_registrations_for_tests()
    selector._clear_cache_for_tests()
    quant_registry._clear_registrations_for_tests()
    ops_registry._reset_for_tests()
    ModelRegistry._restore_builtins_for_tests()


def _unload_modules_under(roots: list[Path]) -> None:
    prefixes = tuple({os.path.join(str(p), "") for r in roots for p in (r, r.resolve())})
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and file.startswith(prefixes):
            del sys.modules[name]


@contextmanager
def fresh_plugin_state(*dist_roots: Path | str) -> Iterator[None]:
    """Within the block: no plugin loaded, no platform resolved, ``dist_roots`` first on sys.path."""
    import llmhal.platforms as platforms
    import llmhal.plugins as plugins

    roots = [Path(r) for r in dist_roots]
    with plugins._general_lock, plugins._lock:
        saved_plugins = (dict(plugins._records), dict(plugins._loaded), plugins._general_loaded)
    with platforms._lock:
        saved_platform = (platforms._platform, platforms._selection)
    saved_path = list(sys.path)
    plugins._reset_for_tests()
    platforms.set_current_platform(None)
    _clear_registries()
    sys.path[:0] = [str(r) for r in roots]
    try:
        yield
    finally:
        sys.path[:] = saved_path
        _unload_modules_under(roots)
        _clear_registries()
        plugins._reset_for_tests()
        with plugins._general_lock, plugins._lock:
            plugins._records.update(saved_plugins[0])
            plugins._loaded.update(saved_plugins[1])
            plugins._general_loaded = saved_plugins[2]
        platforms.set_current_platform(*saved_platform)


@contextmanager
def switched_platform() -> Iterator[Callable[[P], P]]:
    """Within the block, ``use(platform)`` makes ``platform`` the current one and returns it.

    The attention selector's cache is cleared at each switch (selection asks the new platform), and
    on exit the previous platform and its selection record come back.
    """
    from llmhal.attention import selector
    from llmhal.platforms import get_current_platform, get_platform_selection, set_current_platform

    previous = (get_current_platform(), get_platform_selection())
    selector._clear_cache_for_tests()

    def use(platform: P) -> P:
        set_current_platform(platform)
        selector._clear_cache_for_tests()
        return platform

    try:
        yield use
    finally:
        set_current_platform(*previous)
        selector._clear_cache_for_tests()
