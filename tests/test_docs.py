"""The docs stay true: the platform walk-through is a working package, the reference lists what exists."""

from __future__ import annotations

import ast
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmhal import envs
from llmhal.plugins import GROUPS
from llmhal.plugins.hookspecs import LlmhalHookSpecs
from llmhal.testing.distributions import (
    FakeDistribution,
    build_distributions,
    run_cli,
    run_python,
    subprocess_env,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
WALKTHROUGH = DOCS / "writing-a-platform.md"
REFERENCE = (DOCS / "reference.md").read_text()
ENV_LITERAL = re.compile(r"""["']((?:LLMHAL|VLLM)_[A-Z0-9_]+)["']""")
FILE_BLOCK = re.compile(r"```(?:python|toml)\n# file: (\S+)\n(.*?)```", re.S)

# Stands in for the vendor's runtime library, so the walk-through's package finds "a device".
ACME_RUNTIME = """
from collections import namedtuple

_Memory = namedtuple("_Memory", "free total")


def device_count():
    return 1


def device_name(index):
    return "Acme NPU 1000"


def memory_info(index):
    return _Memory(24 << 30, 32 << 30)


def set_device(index):
    pass


def synchronize(index):
    pass


def manual_seed_all(seed):
    pass
"""


def _walkthrough_files() -> dict[str, str]:
    return dict(FILE_BLOCK.findall(WALKTHROUGH.read_text()))


@pytest.fixture(scope="module")
def acme(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the package from the walk-through, a stub acme_runtime, the doc's test file)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    files = _walkthrough_files()
    project = tomllib.loads(files.pop("pyproject.toml"))["project"]
    test_source = files.pop("tests/test_acme_conformance.py")
    base = tmp_path_factory.mktemp("acme")
    package = build_distributions(
        base / "package",
        FakeDistribution(
            project["name"], project["version"], project["entry-points"], modules=files
        ),
    )
    runtime = build_distributions(
        base / "runtime",
        FakeDistribution("acme-runtime", "3.0", modules={"acme_runtime.py": ACME_RUNTIME}),
    )
    test_file = base / "tests" / "test_acme_conformance.py"
    test_file.parent.mkdir()
    test_file.write_text(test_source)
    return package, runtime, test_file


def test_walkthrough_files_are_complete_python():
    files = _walkthrough_files()
    assert {
        "acme_npu/__init__.py",
        "acme_npu/platform.py",
        "acme_npu/attention.py",
        "acme_npu/ops.py",
        "pyproject.toml",
        "tests/test_acme_conformance.py",
    } <= set(files)
    for name, source in files.items():
        if name.endswith(".py"):
            ast.parse(source, name)


def test_walkthrough_platform_is_chosen_when_its_device_is_present(acme):
    package, runtime, _ = acme
    proc = run_cli("doctor", "--json", path=[package, runtime])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["platform"]["name"], report["platform"]["selected_by"]) == ("acme", "probe")
    assert report["platform"]["device"]["device_name"] == "Acme NPU 1000"
    row = next(p for p in report["plugins"] if p["name"] == "acme")
    assert (row["distribution"], row["version"], row["status"]) == ("acme-npu", "1.0.0", "selected")
    backends = {b["name"]: b for b in report["attention_backends"]}
    assert backends["acme_attn"]["provider"] == "acme" and backends["acme_attn"]["available"]
    ops = {o["name"]: o for o in report["ops"]}
    assert (ops["rms_norm"]["implementation"], ops["rms_norm"]["source"]) == (
        "acme_npu.ops:rms_norm",
        "acme",
    )


def test_walkthrough_platform_explains_a_missing_runtime(acme):
    package, _, _ = acme
    code = """
    import llmhal.platforms as platforms

    sel = platforms.get_platform_selection()
    acme = next(p for p in sel.probes if p.name == "acme")
    print(sel.name)
    print(acme.status, "|", acme.reason)
    """
    proc = run_python(code, path=[package])
    assert proc.returncode == 0, proc.stderr
    chosen, acme_line = proc.stdout.splitlines()
    assert chosen == "cpu"
    assert acme_line.startswith("unavailable | the Acme runtime is not installed")
    assert "pip install acme-runtime" in acme_line


def test_walkthrough_conformance_test_passes(acme):
    package, _, test_file = acme
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
        cwd=test_file.parent,
        env=subprocess_env([package]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "3 passed, 1 skipped" in proc.stdout  # the live-instance checks need the device


def _env_vars_in_source() -> set[str]:
    roots = [ROOT / "core", ROOT / "platforms"] + [
        ROOT / f"platforms_{v}" / f"llmhal_{v}" for v in ("cpu", "cuda", "rocm")
    ]
    found = set()
    for root in roots:
        for path in root.rglob("*.py"):
            found |= set(ENV_LITERAL.findall(path.read_text()))
    return found


def test_reference_lists_every_environment_variable():
    variables = set(envs.ENV_VARS) | _env_vars_in_source()
    missing = sorted(v for v in variables if f"`{v}`" not in REFERENCE)
    assert not missing, f"document these in docs/reference.md: {missing}"


def test_reference_lists_every_plugin_group_and_hook():
    for group in GROUPS:
        assert f"`{group}`" in REFERENCE
    hooks = [n for n, _ in inspect.getmembers(LlmhalHookSpecs) if n.startswith("llmhal_")]
    assert len(hooks) == 4
    for hook in hooks:
        assert f"`{hook}(" in REFERENCE, hook


def test_readme_quick_start_is_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert block.splitlines() == [
        'ci/setup && .venv/bin/llmhal generate --prompt "What is the capital of France?"',
        "ci/test",
    ]
    for script in ("ci/setup", "ci/test", "ci/lint"):
        assert (ROOT / script).exists(), script
