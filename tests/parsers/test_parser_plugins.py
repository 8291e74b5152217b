"""--tool-parser-plugin / --reasoning-parser-plugin: a parser loaded from a file path and from a
module name registers itself and is found by name; a plugin that fails to import is logged and
registers nothing (vLLM's behaviour)."""

from __future__ import annotations

import sys

import pytest

from llmhal.reasoning.manager import ReasoningParserManager
from llmhal.tool_parsers.manager import ToolParserManager

TOOL_PLUGIN = """
from llmhal.tool_parsers.base import ExtractedToolCallInformation, ToolParser
from llmhal.tool_parsers.manager import ToolParserManager

@ToolParserManager.register_module("{name}")
class Shouting(ToolParser):
    def extract_tool_calls(self, model_output, request):
        return ExtractedToolCallInformation(False, [], model_output.upper())
"""
REASONING_PLUGIN = """
from llmhal.reasoning.base import ReasoningParser
from llmhal.reasoning.manager import ReasoningParserManager

@ReasoningParserManager.register_module("{name}")
class AllReasoning(ReasoningParser):
    def extract_reasoning(self, model_output, request=None):
        return model_output, None
"""


@pytest.fixture(autouse=True)
def restored_registries():
    """Each test's plugins are forgotten after it (other tests list the registered names)."""
    saved = [(m, dict(m.eager), dict(m.lazy)) for m in (ToolParserManager, ReasoningParserManager)]
    yield
    for m, eager, lazy in saved:
        m.eager.clear()
        m.eager.update(eager)
        m.lazy.clear()
        m.lazy.update(lazy)


MANAGERS = {"tool": (ToolParserManager, TOOL_PLUGIN), "reasoning": (ReasoningParserManager, REASONING_PLUGIN)}  # fmt: skip


def _check(manager, name: str, kind: str) -> None:
    cls = manager.get(name)
    if kind == "tool":
        assert cls(None).extract_tool_calls("hi", {}).content == "HI"
    else:
        assert cls(None).extract_reasoning("hi") == ("hi", None)


@pytest.mark.parametrize("kind", MANAGERS)
def test_a_parser_from_a_file_path(kind, tmp_path):
    manager, source = MANAGERS[kind]
    name = f"file_{kind}_plugin"
    path = tmp_path / f"{name}.py"
    path.write_text(source.format(name=name))
    manager.import_plugin(str(path))
    assert name in manager.list_registered()
    _check(manager, name, kind)


@pytest.mark.parametrize("kind", MANAGERS)
def test_a_parser_from_a_module_name(kind, tmp_path, monkeypatch):
    manager, source = MANAGERS[kind]
    name = f"module_{kind}_plugin"
    pkg = tmp_path / f"pkg_{kind}"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "parsers.py").write_text(source.format(name=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    manager.import_plugin(f"pkg_{kind}.parsers")
    assert name in manager.list_registered()
    _check(manager, name, kind)
    assert f"pkg_{kind}.parsers" in sys.modules


@pytest.mark.parametrize("kind", MANAGERS)
def test_a_plugin_that_fails_is_logged_and_registers_nothing(kind, tmp_path, caplog):
    manager, _ = MANAGERS[kind]
    before = manager.list_registered()
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('broken plugin')\n")
    manager.import_plugin(str(bad))
    manager.import_plugin("no_such_module_anywhere")
    assert manager.list_registered() == before
    assert "broken plugin" in caplog.text and "no_such_module_anywhere" in caplog.text


def test_serve_loads_a_module_named_plugin_before_checking_the_parser_name(tmp_path, monkeypatch, capsys):  # fmt: skip
    """``llmhal serve --tool-parser-plugin MODULE --tool-call-parser NAME`` finds the plugin's
    parser (it fails later, at the port, not at the parser name)."""
    from llmhal.entrypoints.serve import main

    (tmp_path / "served_plugin.py").write_text(TOOL_PLUGIN.format(name="served_by_module"))
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["--tool-parser-plugin", "served_plugin", "--tool-call-parser", "served_by_module", "--enable-auto-tool-choice", "--host", "256.0.0.1"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "unknown --tool-call-parser" not in err and "cannot listen" in err


def test_status_lists_every_parser_and_a_broken_one_with_its_reason(monkeypatch):
    monkeypatch.setitem(ToolParserManager.lazy, "broken_one", ("no_such_module.parsers", "Nope"))
    rows = {r["name"]: r for r in ToolParserManager.status()}
    assert set(rows) == set(ToolParserManager.list_registered())
    assert rows["hermes"] == {"name": "hermes", "class_path": "llmhal.tool_parsers.hermes:HermesToolParser", "available": True, "reasons": []}  # fmt: skip
    assert not rows["broken_one"]["available"] and "no_such_module" in rows["broken_one"]["reasons"][0]  # fmt: skip
    assert all(r["available"] for r in ReasoningParserManager.status())


def test_doctor_renders_the_parser_sections():
    """The doctor's text report has a section per registry (the CLI's JSON sections are
    checked in tests/test_doctor.py, which runs the whole report once)."""
    from llmhal import doctor

    class Report(dict):  # the other sections empty, whichever the doctor has
        def __missing__(self, key):
            return []

    report = Report(llmhal={"llmhal": "0"}, env={}, tool_parsers=ToolParserManager.status(),
                    reasoning_parsers=ReasoningParserManager.status(),
                    platform={"name": None, "class": None, "selected_by": "none", "reason": "-"})  # fmt: skip
    text = doctor.format_report(report)
    assert "Tool-call parsers (--tool-call-parser):" in text and "  qwen3_coder " in text
    assert "Reasoning parsers (--reasoning-parser):" in text and "  hunyuan_a13b " in text
