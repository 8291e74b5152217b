"""Plugins written for vLLM, installed beside llmhal: skipped quietly unless the user lists them.

The distributions mirror vLLM's own test plugin packages (vllm-project/vllm tests/plugins: a
``vllm_add_dummy_model`` with a general plugin and no requirements at all) and third-party vLLM
plugins that declare ``vllm`` as a requirement. vLLM is not installed here, so any of them that ran
would fail on ``import vllm``.
"""

from __future__ import annotations

import logging

import pytest

import llmhal.platforms as platforms
import llmhal.plugins as plugins
from llmhal.testing.distributions import FakeDistribution, marker_code, marker_count
from llmhal.testing.fake_vendor import GENERAL, PLATFORM

IMPORTS_VLLM = "import vllm  # noqa\n\n\ndef register():\n    pass\n"


def _vllm_plugin(dist: str, module: str, requires=(), group=GENERAL, value="register"):
    return FakeDistribution(
        dist,
        "0.1",
        entry_points={group: {f"{module}_ep": f"{module}:{value}"}},
        modules={f"{module}/__init__.py": marker_code(module) + IMPORTS_VLLM},
        requires=requires,
    )


DUMMY_MODEL = _vllm_plugin("vllm_add_dummy_model", "vllm_add_dummy_model")  # no requirements
REQUIRES_VLLM = _vllm_plugin("acme-vllm-kernels", "acme_kernels", requires=["vllm>=0.8", "torch"])
VLLM_PLATFORM_PLUGIN = _vllm_plugin(
    "acme-vllm-platform", "acme_platform", requires=["vllm"], group=PLATFORM, value="probe"
)
# Names no requirement and imports vllm: caught when its import fails, still without a traceback.
SILENT = _vllm_plugin("silent-plugin", "silent_plugin")
# Serves both frameworks: it names llmhal (in an extra), so llmhal loads it.
DUAL = FakeDistribution(
    "dual-plugin",
    "0.1",
    entry_points={GENERAL: {"dual_ep": "dual_plugin:register"}},
    modules={"dual_plugin/__init__.py": marker_code("dual_plugin") + "def register():\n    pass\n"},
    requires=["vllm>=0.8", "llmhal>=0.1; extra == 'llmhal'"],
)


def _rows():
    return {r.name: r for r in plugins.plugin_records()}


def test_vllm_plugins_are_skipped_with_one_info_line_and_no_traceback(
    install_dists, markers, caplog
):
    install_dists(DUMMY_MODEL, REQUIRES_VLLM, VLLM_PLATFORM_PLUGIN, SILENT, DUAL)
    with caplog.at_level(logging.INFO, logger="llmhal"):
        plugins.load_general_plugins()
        assert platforms.current_platform.name == "cpu"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in caplog.records if r.exc_info]
    skipped = [r.getMessage() for r in caplog.records if "written for vLLM" in r.getMessage()]
    assert len(skipped) == 2, skipped  # the summary line, and the one found by its import failure
    summary = next(m for m in skipped if m.startswith("Skipping 3 plugin(s)"))
    assert "acme-vllm-kernels requires vllm and not llmhal" in summary
    assert "vllm_add_dummy_model is named as a vLLM plugin" in summary
    rows = _rows()
    for name in (
        "vllm_add_dummy_model_ep",
        "acme_kernels_ep",
        "acme_platform_ep",
        "silent_plugin_ep",
    ):
        assert rows[name].status == plugins.TARGETS_VLLM == "targets vLLM", name
        assert "VLLM_PLUGINS" in rows[name].reason
    # Skipped from metadata alone: never imported (so, with vLLM installed, never run).
    for module in ("vllm_add_dummy_model", "acme_kernels", "acme_platform"):
        assert marker_count(markers, module) == 0, module
    assert rows["dual_ep"].status == plugins.LOADED and marker_count(markers, "dual_plugin") == 1
    said = {p.name: p for p in platforms.get_platform_selection().probes}
    assert said["acme_platform_ep"].status == "not loaded"
    assert "requires vllm" in said["acme_platform_ep"].reason


def test_doctor_lists_vllm_plugins_as_targeting_vllm(install_dists):
    from llmhal import doctor

    install_dists(DUMMY_MODEL, REQUIRES_VLLM)
    report = doctor.collect()
    rows = {r["name"]: r for r in report["plugins"]}
    assert rows["acme_kernels_ep"]["status"] == "targets vLLM"
    assert rows["vllm_add_dummy_model_ep"]["status"] == "targets vLLM"
    assert not [e for e in report["errors"] if "vllm" in e.lower()]
    assert "targets vLLM" in doctor.format_report(report)


def test_a_listed_vllm_plugin_is_loaded_and_its_failure_is_an_error(
    install_dists, markers, monkeypatch
):
    install_dists(DUMMY_MODEL)
    monkeypatch.setenv("VLLM_PLUGINS", "llmhal_cpu,vllm_add_dummy_model_ep")
    with pytest.raises(plugins.PluginLoadError, match="No module named 'vllm'"):
        plugins.load_general_plugins()
    assert marker_count(markers, "vllm_add_dummy_model") == 1
