"""``llmhal new-platform NAME``: a complete package that installs, passes the kit and generates.

The walk-through's test (tests/test_docs.py) runs the generated files for ``acme`` through the kit
and ``generate`` on every fast run; the slow test here installs a package generated under another
name with pip, as a vendor would, and does the same.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from llmhal.entrypoints.cli import main as cli_main
from llmhal.entrypoints.new_platform import name_problem, render
from llmhal.testing.distributions import run_python, subprocess_env


def test_render_names_everything_after_the_platform():
    tomllib = pytest.importorskip("tomllib")
    files = render("acme_npu")
    assert sorted(files) == [
        "README.md",
        "acme_npu/__init__.py",
        "acme_npu/attention.py",
        "acme_npu/attention_impl.py",
        "acme_npu/device.py",
        "acme_npu/ops.py",
        "acme_npu/platform.py",
        "pyproject.toml",
        "tests/test_acme_npu_conformance.py",
    ]
    text = "".join(files.values())
    assert "mynpu" not in text.lower()
    assert "class AcmeNpuPlatform(Platform)" in files["acme_npu/platform.py"]
    assert 'name = "acme_npu"' in files["acme_npu/platform.py"]  # declared by the probe too
    assert '@platform_probe("acme_npu.platform:AcmeNpuPlatform", name="acme_npu")' in text
    assert 'device_control_env_var = "ACME_NPU_VISIBLE_DEVICES"' in files["acme_npu/platform.py"]
    for path, source in files.items():
        if path.endswith(".py"):
            ast.parse(source, path)
    project = tomllib.loads(files["pyproject.toml"])["project"]
    assert project["entry-points"]["vllm.platform_plugins"] == {
        "acme_npu": "acme_npu:acme_npu_platform_plugin"
    }


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("AcmeNPU", "is not a valid name: use a lower-case Python identifier"),
        ("class", "is not a valid name"),
        ("torch", "a module named 'torch' is already importable here"),
        ("llmhal_cpu", "already importable here"),
        ("cuda", "'cuda' is one of vLLM's built-in platform names (cpu, cuda, hpu, neuron,"),
        ("neuron", "choose another name (e.g. 'acme_neuron')"),
    ],
)
def test_names_that_cannot_be_used_are_refused_with_the_reason(name, why):
    assert why in name_problem(name)


def test_cli_writes_the_package_and_refuses_to_overwrite(tmp_path, capsys):
    folder = tmp_path / "pkg"
    assert cli_main(["new-platform", "acme", "--dir", str(folder)]) == 0
    written = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    assert written == set(render("acme"))
    assert (folder / "acme" / "platform.py").read_text() == render("acme")["acme/platform.py"]
    out = capsys.readouterr().out
    assert f"pip install -e {folder}" in out and "pytest --llmhal-platform=acme" in out
    assert cli_main(["new-platform", "acme", "--dir", str(folder)]) == 2
    assert "already exists and is not an empty folder" in capsys.readouterr().err
    assert cli_main(["new-platform", "Bad Name"]) == 2


@pytest.mark.slow
def test_generated_package_installs_with_pip_passes_the_kit_and_generates(tmp_path):
    from llmhal.testing.tiny_models import make_tiny_model

    assert cli_main(["new-platform", "zetta_npu", "--dir", str(tmp_path / "src")]) == 0
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(
        [*pip, "--target", str(site), str(tmp_path / "src")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (site / "zetta_npu" / "attention_impl.py").exists()

    # Run outside the repository, so its addopts (-p no:langsmith_plugin) are not read.
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    pytest_cmd += ["-p", "no:langsmith_plugin", "--llmhal-platform=zetta_npu", "tests"]
    proc = subprocess.run(  # the kit through the plugin, and the package's own tests
        pytest_cmd,
        cwd=tmp_path / "src",
        env=subprocess_env([site]),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "12 passed, 2 skipped" in proc.stdout

    model = tmp_path / "tiny"
    make_tiny_model(model, "llama")
    code = "import sys\nfrom llmhal.entrypoints.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    for dtype in ("bfloat16", "float32"):
        args = ["generate", "--model", str(model), "--dtype", dtype, "--prompt", "Paris is"]
        proc = run_python(
            code, path=[site], args=[*args, "--max-tokens", "6", "--json"], timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        answer, summary = (json.loads(line) for line in proc.stdout.splitlines())
        assert len(answer["token_ids"]) == 6
        assert summary["summary"]["platform"] == "zetta_npu"
        assert summary["summary"]["attention_backend"] == "zetta_npu_attn"
