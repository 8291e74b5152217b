"""Every file a package reads at run time (kernel sources compiled on first use) ships in its wheel."""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_SUFFIXES = (".cpp", ".h")


@pytest.mark.parametrize("vendor", ["cpu", "cuda", "rocm"])
def test_runtime_sources_are_package_data(vendor):
    project = ROOT / f"platforms_{vendor}"
    package = f"llmhal_{vendor}"
    config = tomllib.loads((project / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"].get("package-data", {}).get(package, [])
    base = project / package
    needed = [p for p in base.rglob("*") if p.suffix in RUNTIME_SUFFIXES]
    missing = [
        str(p.relative_to(base)) for p in needed
        if not any(fnmatch(str(p.relative_to(base)), g) for g in globs)
    ]  # fmt: skip
    assert not missing, f"add to [tool.setuptools.package-data] of {project.name}: {missing}"
