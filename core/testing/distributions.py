"""Throwaway Python distributions for plugin tests, without pip.

A folder holding ``<name>-<version>.dist-info/`` (``METADATA`` + ``entry_points.txt``) next to the
distribution's modules is all ``importlib.metadata`` needs: put the folder on ``sys.path`` (or on
``PYTHONPATH`` of a subprocess) and its entry points are discovered like an installed package's. The
real installed packages stay visible, so a test sees e.g. the CPU platform beside the fake vendor.

Modules built here may call :func:`marker_code` so a test can prove whether a module was ever
imported (the allow-list promise: a plugin that is not allowed never runs).

Example::

    dist = FakeDistribution(
        "fake-vendor", "1.0",
        entry_points={"vllm.general_plugins": {"fake": "fake_vendor:register"}},
        modules={"fake_vendor/__init__.py": marker_code("fake_vendor") + "def register(): pass\\n"},
    )
    root = build_distributions(tmp_path, dist)
    proc = run_python("import llmhal.plugins as p; p.load_general_plugins()", path=[root])
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Modules built with marker_code() append a line to <this folder>/<marker name> when imported.
MARKER_DIR_ENV = "LLMHAL_TEST_MARKER_DIR"

# Inherited variables that would change what a subprocess discovers or selects.
_PLUGIN_ENV = ("VLLM_PLUGINS", "VLLM_PLATFORM", "VLLM_ATTENTION_BACKEND")


@dataclass(frozen=True)
class FakeDistribution:
    """One distribution: metadata, entry points by group, module sources by relative path, and its
    requirements (``Requires-Dist`` lines, e.g. ``"vllm>=0.8"``)."""

    name: str
    version: str = "0.0.1"
    entry_points: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    modules: Mapping[str, str] = field(default_factory=dict)
    requires: Sequence[str] = ()

    @property
    def dist_info_name(self) -> str:
        return f"{self.name.replace('-', '_')}-{self.version}.dist-info"


def _entry_points_txt(entry_points: Mapping[str, Mapping[str, str]]) -> str:
    parts = []
    for group, eps in entry_points.items():
        lines = [f"[{group}]"] + [f"{name} = {value}" for name, value in eps.items()]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def build_distributions(root: Path | str, *dists: FakeDistribution) -> Path:
    """Write ``dists`` into the folder ``root`` (created if needed) and return it.

    The folder is what goes on ``sys.path``/``PYTHONPATH``. Module sources are dedented, so they may
    be written as indented triple-quoted strings.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for dist in dists:
        info = root / dist.dist_info_name
        info.mkdir(exist_ok=True)
        requires = "".join(f"Requires-Dist: {r}\n" for r in dist.requires)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist.name}\nVersion: {dist.version}\n{requires}"
        )
        if dist.entry_points:
            (info / "entry_points.txt").write_text(_entry_points_txt(dist.entry_points))
        for rel, source in dist.modules.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))
    return root


def marker_code(marker: str) -> str:
    """Python source that appends a line to the marker file ``marker`` when executed.

    Does nothing unless :data:`MARKER_DIR_ENV` is set, so the module also works outside tests.
    """
    return (
        "import os as _os\n"
        f"if _os.environ.get({MARKER_DIR_ENV!r}):\n"
        f"    with open(_os.path.join(_os.environ[{MARKER_DIR_ENV!r}], {marker!r}), 'a') as _f:\n"
        "        _f.write('x\\n')\n"
    )


def marker_count(marker_dir: Path | str, marker: str) -> int:
    """How many times the code of :func:`marker_code` ran for ``marker`` (0 = never)."""
    path = Path(marker_dir) / marker
    return len(path.read_text().splitlines()) if path.exists() else 0


def subprocess_env(
    path: Iterable[Path | str] = (),
    env: Mapping[str, str | None] | None = None,
    marker_dir: Path | str | None = None,
) -> dict[str, str]:
    """The environment for a subprocess that sees ``path`` first, then everything installed.

    Plugin-selection variables inherited from the caller are dropped so the test decides them;
    ``env`` sets variables (a None value unsets one).
    """
    out = {k: v for k, v in os.environ.items() if k not in _PLUGIN_ENV}
    front = [str(p) for p in path]
    if out.get("PYTHONPATH"):
        front.append(out["PYTHONPATH"])
    if front:
        out["PYTHONPATH"] = os.pathsep.join(front)
    if marker_dir is not None:
        out[MARKER_DIR_ENV] = str(marker_dir)
    for key, value in (env or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def run_python(
    code: str,
    *,
    path: Iterable[Path | str] = (),
    env: Mapping[str, str | None] | None = None,
    marker_dir: Path | str | None = None,
    args: Sequence[str] = (),
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (dedented) in a fresh interpreter of this environment; never raises on failure.

    The caller checks ``returncode``, ``stdout`` and ``stderr``.
    """
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=subprocess_env(path, env, marker_dir),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_cli(
    *argv: str,
    path: Iterable[Path | str] = (),
    env: Mapping[str, str | None] | None = None,
    marker_dir: Path | str | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run ``llmhal <argv>`` in a fresh interpreter (through the CLI's ``main``)."""
    code = "import sys\nfrom llmhal.entrypoints.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return run_python(code, path=path, env=env, marker_dir=marker_dir, args=argv, timeout=timeout)
