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
from llmhal.entrypoints.new_platform import render
from llmhal.plugins import GROUPS
from llmhal.plugins.hookspecs import LlmhalHookSpecs
from llmhal.testing.distributions import (
    FakeDistribution,
    build_distributions,
    run_python,
    subprocess_env,
)
from llmhal.testing.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
WALKTHROUGH = DOCS / "writing-a-platform.md"
REFERENCE = (DOCS / "reference.md").read_text()
ENV_LITERAL = re.compile(r"""["']((?:LLMHAL|VLLM)_[A-Z0-9_]+)["']""")
# A file of the walk-through's package: a fenced block whose first line names it (the README's
# fence is four backticks, as it holds fences of its own).
FILE_BLOCK = re.compile(
    r"^(`{3,4})(?:python|toml|markdown)\n(?:# file: (\S+)|<!-- file: (\S+) -->)\n(.*?)^\1$",
    re.S | re.M,
)
PROMPT = "Paris is the capital"


def _walkthrough_files() -> dict[str, str]:
    return {
        code or markdown: text
        for _, code, markdown, text in FILE_BLOCK.findall(WALKTHROUGH.read_text())
    }


def test_walkthrough_is_the_package_new_platform_writes():
    files = _walkthrough_files()
    assert files == render("acme")  # every file, as written: the guide starts from the generator
    for name, source in files.items():
        if name.endswith(".py"):
            ast.parse(source, name)


@pytest.fixture(scope="module")
def acme(tmp_path_factory) -> tuple[Path, Path]:
    """(the walk-through's package installed in a throwaway folder, the package's own test file)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    files = _walkthrough_files()
    project = tomllib.loads(files.pop("pyproject.toml"))["project"]
    files.pop("README.md")
    test_source = files.pop("tests/test_acme_conformance.py")
    base = tmp_path_factory.mktemp("acme")
    package = build_distributions(
        base / "package",
        FakeDistribution(
            project["name"], project["version"], project["entry-points"], modules=files
        ),
    )
    test_file = base / "tests" / "test_acme_conformance.py"
    test_file.parent.mkdir()
    test_file.write_text(test_source)
    return package, test_file


def test_walkthrough_platform_explains_a_hidden_device(acme):
    package, _ = acme
    code = """
    import llmhal.platforms as platforms

    sel = platforms.get_platform_selection()
    acme = next(p for p in sel.probes if p.name == "acme")
    print(sel.name)
    print(acme.status, "|", acme.reason)
    """
    proc = run_python(code, path=[package], env={"ACME_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    chosen, acme_line = proc.stdout.splitlines()
    assert chosen == "cpu"
    assert acme_line == (
        "unavailable | no acme device is visible (ACME_VISIBLE_DEVICES is set and empty)"
    )


def test_walkthrough_passes_the_kit_and_its_own_conformance_test(acme):
    # The kit through the pytest plugin (no test file) and the package's test, in one run.
    package, test_file = acme
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"]
        + ["-p", "no:langsmith_plugin", "--llmhal-platform=acme", str(test_file)],
        cwd=test_file.parent,
        env=subprocess_env([package]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for suite in ("llmhal-platform-kit[acme]::TestAcmeKit", "test_acme_conformance.py::TestAcme"):
        for test in ("test_instance", "test_attention_backend_runs[acme_attn]"):
            assert re.search(rf"PASSED \S*{re.escape(suite)}\S*::{re.escape(test)}", proc.stdout)
    assert "12 passed, 2 skipped" in proc.stdout  # skipped: no quantization method declared


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> tuple[Path, list[int]]:
    """A tiny random Llama checkpoint and transformers' greedy continuation of PROMPT."""
    import torch
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny_llama")
    model = make_tiny_model(folder, "llama")
    ids = AutoTokenizer.from_pretrained(folder)(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    return folder, out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def acme_commands(acme, tiny_llama) -> dict[str, list[str]]:
    """stdout of `llmhal doctor --json` and of `llmhal generate --json` in bfloat16 and float32 on
    the walk-through's package (one interpreter for the three: each start costs seconds)."""
    package, _ = acme
    model, _ = tiny_llama
    code = """
    import contextlib, io, json, sys
    from llmhal.entrypoints.cli import main

    gen = ["generate", "--model", sys.argv[1], "--prompt", sys.argv[2], "--no-chat"]
    gen += ["--max-tokens", "8", "--json"]
    runs = {
        "doctor": ["doctor", "--json"],
        "bfloat16": gen + ["--dtype", "bfloat16"],
        "float32": gen + ["--dtype", "float32"],
    }
    out = {}
    for key, argv in runs.items():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            status = main(argv)
        out[key] = [f"status {status}", *buf.getvalue().splitlines()]
    print(json.dumps(out))
    """
    proc = run_python(code, path=[package], args=[str(model), PROMPT], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    for key, lines in out.items():
        assert lines[0] == "status 0", (key, proc.stderr[-3000:])
    return {key: lines[1:] for key, lines in out.items()}


def test_walkthrough_platform_is_chosen_when_its_device_is_present(acme_commands):
    report = json.loads("\n".join(acme_commands["doctor"]))
    assert (report["platform"]["name"], report["platform"]["selected_by"]) == ("acme", "probe")
    assert report["platform"]["device"]["device_name"] == "acme 0 (host CPU stand-in)"
    row = next(p for p in report["plugins"] if p["name"] == "acme")
    assert (row["distribution"], row["version"], row["status"]) == ("acme", "0.1.0", "selected")
    backends = {b["name"]: b for b in report["attention_backends"]}
    assert backends["acme_attn"]["provider"] == "acme" and backends["acme_attn"]["available"]
    ops = {o["name"]: o for o in report["ops"]}
    assert (ops["rms_norm"]["implementation"], ops["rms_norm"]["source"]) == (
        "acme.ops:rms_norm",
        "acme",
    )


def test_walkthrough_generates_in_bfloat16_and_float32(acme_commands, tiny_llama):
    _, expected = tiny_llama
    for dtype in ("bfloat16", "float32"):
        answer, summary = (json.loads(line) for line in acme_commands[dtype])
        summary = summary["summary"]
        assert (summary["platform"], summary["attention_backend"], summary["dtype"]) == (
            "acme",
            "acme_attn",
            dtype,
        )
        assert len(answer["token_ids"]) == 8
        if dtype == "float32":
            assert answer["token_ids"] == expected  # transformers' greedy tokens


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


def test_guide_and_readme_say_how_to_name_a_platform():
    from llmhal.platforms.resolver import VLLM_BUILTIN_PLATFORMS

    guide = WALKTHROUGH.read_text()
    for name in VLLM_BUILTIN_PLATFORMS:  # the guide names every one a vendor must avoid
        assert f"`{name}`" in guide, name
    readme = (ROOT / "README.md").read_text().split("## Writing a platform package", 1)[1]
    for text in (guide, readme):
        assert '@platform_probe("' in text and ', name="' in text
        assert "VLLM_BUILTIN_PLATFORMS" in text
