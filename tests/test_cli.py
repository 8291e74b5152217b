"""The `llmhal` command: help, dispatch to subcommand modules, and builds that lack a module."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmhal.entrypoints import cli

RECORDER = "CALLS = []\n\n\ndef main(argv):\n    CALLS.append(list(argv))\n    return 3\n"


@pytest.fixture
def fake_modules(tmp_path, monkeypatch):
    """A package ``fake_cli_pkg`` with a recording ``cmd`` module and benchmarks ``alpha``/``beta``."""
    pkg = tmp_path / "fake_cli_pkg"
    (pkg / "benchmarks").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cmd.py").write_text(RECORDER)
    (pkg / "benchmarks" / "__init__.py").write_text("")
    (pkg / "benchmarks" / "alpha.py").write_text(RECORDER)
    (pkg / "benchmarks" / "beta.py").write_text("def main(argv):\n    return None\n")
    (pkg / "benchmarks" / "_helpers.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "BENCHMARKS_PACKAGE", "fake_cli_pkg.benchmarks")
    yield pkg
    for name in [m for m in sys.modules if m.startswith("fake_cli_pkg")]:
        del sys.modules[name]


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("doctor", "generate", "serve", "bench"):
        assert f"  {command}" in out
    assert cli.main([]) == 2  # no command: usage, and a failing status


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("llmhal ")


def test_unknown_command(capsys):
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'" in err and "doctor" in err


def test_subcommand_gets_its_arguments_untouched(fake_modules, monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "generate", ("fake_cli_pkg.cmd", "generate"))
    assert cli.main(["generate", "--prompt", "What is the capital of France?", "--help"]) == 3
    import fake_cli_pkg.cmd

    assert fake_cli_pkg.cmd.CALLS == [["--prompt", "What is the capital of France?", "--help"]]


def test_missing_subcommand_module_is_not_available_in_this_build(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "serve", ("llmhal.entrypoints.no_such_serve", "serve"))
    assert cli.main(["serve", "--port", "8000"]) == 2
    err = capsys.readouterr().err
    assert "`llmhal serve` is not available in this build" in err


def test_bench_dispatches_by_name(fake_modules, capsys):
    assert cli.available_benchmarks() == ["alpha", "beta"]
    assert cli.main(["bench", "alpha", "--iters", "5"]) == 3
    import fake_cli_pkg.benchmarks.alpha as alpha

    assert alpha.CALLS == [["--iters", "5"]]
    assert cli.main(["bench", "beta"]) == 0  # main() returning None means success


@pytest.mark.parametrize("what", ["attention_nope", "../alpha", "Alpha"])
def test_unknown_benchmark_lists_the_available_ones(fake_modules, capsys, what):
    assert cli.main(["bench", what]) == 2
    err = capsys.readouterr().err
    assert "not available in this build" in err and "alpha, beta" in err


def test_bench_without_a_name_prints_the_list(fake_modules, capsys):
    assert cli.main(["bench"]) == 2
    assert "benchmarks: alpha, beta" in capsys.readouterr().out
    assert cli.main(["bench", "--help"]) == 0


def test_console_script_is_installed():
    script = shutil.which("llmhal", path=str(Path(sys.executable).parent))
    assert script, "the llmhal console script is not installed next to this interpreter"
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "doctor" in proc.stdout
