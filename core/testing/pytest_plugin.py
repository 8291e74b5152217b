"""pytest plugin: ``pytest --llmhal-platform=NAME`` runs the platform conformance kit, no test file needed.

Registered through the ``pytest11`` entry point of the ``llmhal`` distribution, so every pytest run in
an environment with llmhal loads this module. Without ``--llmhal-platform`` it only adds its options:
it imports nothing beyond the standard library and pytest, collects nothing and changes no test.

With ``--llmhal-platform=NAME`` (the platform plugin's entry-point name, or its platform's ``name``)
the session also collects ``PlatformConformanceSuite`` (:mod:`llmhal.testing.platform_conformance`)
for that platform: class attributes, contributions, the probe, a live instance, and one test per
declared attention backend, op kernel and quantization method, run on the device against core's
reference (:mod:`llmhal.testing.contribution_checks`). The platform is made the active one
(``VLLM_PLATFORM``), as the engine would see it; when its probe says the device is absent, the tests
that need the device are skipped with the probe's reason. ``--llmhal-quant-config METHOD=JSON`` gives
an example ``quantization_config`` to a method whose ``from_config({})`` cannot build one.
"""

from __future__ import annotations

import importlib
import json
import os
import types
from pathlib import Path
from typing import Any

import pytest

PLATFORM_GROUP = "vllm.platform_plugins"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("llmhal", "llmhal platform conformance kit")
    group.addoption(
        "--llmhal-platform",
        metavar="NAME",
        default=None,
        help="run llmhal's platform conformance kit on the installed platform NAME "
        "(its vllm.platform_plugins entry-point name)",
    )
    group.addoption(
        "--llmhal-quant-config",
        metavar="METHOD=JSON",
        action="append",
        default=[],
        help="an example quantization_config for the kit's check of quantization method METHOD",
    )


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("llmhal_platform", None)
    if name:
        target = KitTarget.find(name, _quant_configs(config.getoption("llmhal_quant_config")))
        config.pluginmanager.register(_KitCollector(target), "llmhal-platform-kit")


def _quant_configs(pairs: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for pair in pairs:
        method, sep, text = pair.partition("=")
        try:
            value = json.loads(text) if sep else None
        except json.JSONDecodeError as e:
            value, why = None, f"not JSON ({e})"
        else:
            why = "expected METHOD={...}"
        if not (method and isinstance(value, dict)):
            raise pytest.UsageError(f"--llmhal-quant-config {pair!r}: {why}")
        out[method] = value
    return out


class KitTarget:
    """The platform under test: its entry point, probe, class, and (once asked) live instance."""

    def __init__(self, entry_name: str, probe: Any, cls: type, quant_configs: dict) -> None:
        self.entry_name, self.probe, self.cls, self.quant_configs = (
            entry_name,
            probe,
            cls,
            quant_configs,
        )
        self._live: tuple[Any, str | None] | None = None

    @classmethod
    def find(cls, name: str, quant_configs: dict[str, dict[str, Any]]) -> KitTarget:
        from importlib.metadata import entry_points

        eps = list(entry_points(group=PLATFORM_GROUP))
        found = [ep for ep in eps if ep.name == name]
        if not found:  # the platform's own name ("cpu") may differ from its entry point's
            found = [ep for ep in eps if _declared_name(ep) == name]
        if not found:
            installed = ", ".join(sorted({ep.name for ep in eps})) or "none"
            raise pytest.UsageError(
                f"--llmhal-platform={name}: no installed platform plugin is called {name!r} "
                f"(installed: {installed}). Install the platform's package first "
                f"(pip install -e <its folder>); `llmhal doctor` lists what is installed."
            )
        ep = found[0]
        probe = ep.load()
        path = getattr(probe, "llmhal_platform_class", None)
        if not isinstance(path, str):
            raise pytest.UsageError(
                f"--llmhal-platform={name}: the probe {ep.value} does not declare its platform "
                f"class; decorate it with @llmhal.platforms.platform_probe('pkg.mod:Class')"
            )
        from llmhal.utils.imports import resolve_obj_by_qualname

        try:
            platform_cls = resolve_obj_by_qualname(path)
        except Exception as e:
            raise pytest.UsageError(
                f"--llmhal-platform={name}: its platform class {path} does not import: "
                f"{type(e).__name__}: {e}"
            ) from e
        # The tests see the platform the engine would: selected by name, through its probe.
        os.environ["VLLM_PLATFORM"] = ep.name
        return cls(ep.name, probe, platform_cls, quant_configs)

    def live(self) -> tuple[Any, str | None]:
        """(the active platform instance, None), or (None, why the device is not usable)."""
        if self._live is None:
            from llmhal.platforms import get_current_platform

            try:
                platform = get_current_platform()
            except Exception as e:
                self._live = (None, f"{type(e).__name__}: {e}")
            else:
                if isinstance(platform, self.cls):
                    self._live = (platform, None)
                else:
                    self._live = (None, f"the active platform is {platform.name}, not {self.cls}")
        return self._live

    def suite_module(self) -> types.ModuleType:
        """A module holding the conformance suite subclassed for this platform."""
        from llmhal.testing.platform_conformance import PlatformConformanceSuite

        target = self

        class Kit(PlatformConformanceSuite):
            platform_cls = target.cls
            probe = staticmethod(target.probe)
            quantization_configs = target.quant_configs

            @classmethod
            def device_available(cls) -> bool:
                return target.live()[0] is not None

            def _live_platform(self) -> Any:
                platform, why = target.live()
                if platform is None:
                    pytest.skip(f"the {target.entry_name} platform is not usable here: {why}")
                return platform

        module = types.ModuleType("llmhal_platform_kit")
        module.__file__ = __file__
        Kit.__name__ = Kit.__qualname__ = f"Test{target.entry_name.title().replace('_', '')}Kit"
        Kit.__module__ = module.__name__
        setattr(module, Kit.__name__, Kit)
        return module


def _declared_name(ep: Any) -> str | None:
    """The platform name an entry point's probe declares (``@platform_probe(..., name=...)``), else
    its platform class's ``name``; None when unknown. Every installed probe is asked, so neither a
    plugin written for vLLM (its import would import vLLM) nor, when the probe declares its name, the
    platform class (torch and the runtime) is imported."""
    from llmhal.plugins.foreign import targets_vllm_reason

    if targets_vllm_reason(ep):
        return None
    try:
        probe = ep.load()
        name = getattr(probe, "llmhal_platform_name", None)
        if isinstance(name, str) and name:
            return name
        path = getattr(probe, "llmhal_platform_class", None)
        if not isinstance(path, str):
            return None
        module, _, attr = path.replace(":", ".").rpartition(".")
        return getattr(getattr(importlib.import_module(module), attr), "name", None)
    except Exception:  # a broken plugin is simply not the one asked for
        return None


class _KitModule(pytest.Module):
    """A collector over the suite module built in memory (no file to import, no import mode)."""

    target: KitTarget

    def _getobj(self) -> types.ModuleType:
        return self.target.suite_module()


class _KitCollector:
    def __init__(self, target: KitTarget) -> None:
        self.target = target

    @pytest.hookimpl(tryfirst=True)  # before -k/-m deselection, so those select among kit tests too
    def pytest_collection_modifyitems(
        self, session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        # A path that names the kit and its platform in every test id (nothing is read from it).
        path = Path(config.rootpath, f"llmhal-platform-kit[{self.target.entry_name}]")
        module = _KitModule.from_parent(session, path=path)
        module.target = self.target
        items[:0] = list(session.genitems(module))
