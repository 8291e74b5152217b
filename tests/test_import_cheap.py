"""`import llmhal` (and the plugin/platform/CLI layers) import neither torch nor any plugin."""

from __future__ import annotations

import pytest

from llmhal.testing.distributions import run_python

HEAVY = ("torch", "numpy", "transformers", "triton", "gguf", "pluggy")
PLUGINS = ("llmhal_cpu", "llmhal_cuda", "llmhal_rocm")

CHECK = """
import sys
{statement}
heavy = sorted(m for m in {heavy!r} if m in sys.modules)
plugins = sorted(m for m in {plugins!r} if m in sys.modules)
print("heavy:", *heavy)
print("plugins:", *plugins)
"""


def _imported(statement: str) -> tuple[str, str]:
    proc = run_python(CHECK.format(statement=statement, heavy=HEAVY, plugins=PLUGINS))
    assert proc.returncode == 0, proc.stderr
    heavy, plugins = proc.stdout.splitlines()
    return heavy.removeprefix("heavy:").strip(), plugins.removeprefix("plugins:").strip()


@pytest.mark.parametrize(
    "statement",
    [
        "import llmhal",
        "import llmhal.platforms",
        "from llmhal.platforms import Platform, PlatformCapabilities, platform_probe",
        "import llmhal.plugins",
        "import llmhal.envs, llmhal.logger, llmhal.utils.imports",
        "import llmhal.doctor",
        "import llmhal.entrypoints.cli",
        "import llmhal.testing.distributions",
    ],
)
def test_import_is_cheap(statement):
    assert _imported(statement) == ("", "")


def test_help_is_cheap():
    statement = (
        "import contextlib, io\n"
        "from llmhal.entrypoints.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['--help']) == 0\n"
    )
    assert _imported(statement) == ("", "")


def test_hookspecs_need_only_pluggy():
    heavy, plugins = _imported("import llmhal.plugins.hookspecs")
    assert heavy == "pluggy" and plugins == ""
