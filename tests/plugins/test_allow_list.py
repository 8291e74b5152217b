"""VLLM_PLUGINS, discovery records and load failures, in this process with throwaway distributions."""

from __future__ import annotations

import logging

import pytest

import llmhal.plugins as plugins
from llmhal.testing.distributions import FakeDistribution, marker_code, marker_count
from llmhal.testing.fake_vendor import GENERAL, IO_PROCESSOR


def _dist(name: str, version: str = "2.0", *, body: str = "", group: str = GENERAL):
    """One distribution ``<name>-dist`` with entry point ``<name> = <name>_mod:hello``."""
    return FakeDistribution(
        f"{name}-dist",
        version,
        entry_points={group: {name: f"{name}_mod:hello"}},
        modules={f"{name}_mod.py": marker_code(f"{name}_mod") + body + "def hello():\n    pass\n"},
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, None),
        ("", frozenset()),
        (" , ", frozenset()),
        ("a", frozenset({"a"})),
        (" a , b,,c ", frozenset({"a", "b", "c"})),
    ],
)
def test_vllm_plugins_parsing(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", raw)
    assert plugins.allowed_plugins() == expected


def test_unset_loads_all_and_records_distribution(install_dists, markers):
    install_dists(_dist("alpha", "1.2.3"), _dist("beta"))
    loaded = plugins.load_plugins_by_group(GENERAL)
    assert set(loaded) == {"alpha", "beta"}
    rec = {r.name: r for r in plugins.plugin_records()}["alpha"]
    assert (rec.group, rec.value, rec.distribution, rec.version, rec.status) == (
        GENERAL,
        "alpha_mod:hello",
        "alpha-dist",
        "1.2.3",
        plugins.LOADED,
    )
    assert marker_count(markers, "alpha_mod") == 1


def test_empty_loads_nothing_and_imports_nothing(install_dists, markers, monkeypatch):
    install_dists(_dist("alpha"), _dist("beta", group=IO_PROCESSOR))
    monkeypatch.setenv("VLLM_PLUGINS", "")
    assert plugins.load_plugins_by_group(GENERAL) == {}
    assert plugins.load_plugins_by_group(IO_PROCESSOR) == {}
    statuses = {r.name: r.status for r in plugins.plugin_records()}
    assert statuses["alpha"] == statuses["beta"] == plugins.NOT_ALLOWED
    assert marker_count(markers, "alpha_mod") == marker_count(markers, "beta_mod") == 0


def test_allow_list_strips_whitespace_and_never_imports_others(install_dists, markers, monkeypatch):
    install_dists(_dist("alpha"), _dist("beta"))
    monkeypatch.setenv("VLLM_PLUGINS", "  alpha ,")
    assert list(plugins.load_plugins_by_group(GENERAL)) == ["alpha"]
    assert marker_count(markers, "alpha_mod") == 1
    assert marker_count(markers, "beta_mod") == 0
    beta = {r.name: r for r in plugins.plugin_records()}["beta"]
    assert beta.status == plugins.NOT_ALLOWED and "VLLM_PLUGINS" in beta.reason


def test_unknown_name_warns_once(install_dists, monkeypatch, caplog):
    install_dists(_dist("alpha"))
    monkeypatch.setenv("VLLM_PLUGINS", "alpha,does_not_exist")
    with caplog.at_level(logging.WARNING, logger="llmhal"):
        plugins.load_plugins_by_group(GENERAL)
        plugins.load_plugins_by_group(GENERAL)
    hits = [r for r in caplog.records if "does_not_exist" in r.getMessage()]
    assert len(hits) == 1
    assert "VLLM_PLUGINS" in hits[0].getMessage() and hits[0].levelno == logging.WARNING


def test_no_warning_when_names_resolve_or_unset(install_dists, monkeypatch, caplog):
    install_dists(_dist("alpha"))
    with caplog.at_level(logging.WARNING, logger="llmhal"):
        plugins.load_plugins_by_group(GENERAL)
        monkeypatch.setenv("VLLM_PLUGINS", "alpha")
        plugins.load_plugins_by_group(GENERAL)
    assert not [r for r in caplog.records if "VLLM_PLUGINS" in r.getMessage()]


def test_import_failure_is_recorded_and_logged_once(install_dists, caplog):
    install_dists(_dist("broken", "0.9", body="raise ImportError('libbroken.so not found')\n"))
    with caplog.at_level(logging.ERROR, logger="llmhal"):
        assert plugins.load_plugins_by_group(GENERAL) == {}
        assert plugins.load_plugins_by_group(GENERAL) == {}
    rec = {r.name: r for r in plugins.plugin_records()}["broken"]
    assert rec.status == plugins.FAILED
    assert "ImportError" in rec.reason and "libbroken.so not found" in rec.reason
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "'broken'" in errors[0] and "broken-dist 0.9" in errors[0]


def test_import_failure_of_an_explicit_plugin_is_an_error(install_dists, monkeypatch):
    install_dists(_dist("broken", "0.9", body="raise RuntimeError('boom')\n"))
    monkeypatch.setenv("VLLM_PLUGINS", "broken")
    with pytest.raises(plugins.PluginLoadError) as err:
        plugins.load_plugins_by_group(GENERAL)
    msg = str(err.value)
    assert "'broken'" in msg and "broken-dist 0.9" in msg and "RuntimeError: boom" in msg
    assert "VLLM_PLUGINS" in msg


def test_loading_is_idempotent(install_dists, markers):
    install_dists(_dist("alpha"))
    first = plugins.load_plugins_by_group(GENERAL)
    second = plugins.load_plugins_by_group(GENERAL)
    assert first["alpha"] is second["alpha"]
    assert marker_count(markers, "alpha_mod") == 1


def test_same_name_from_two_distributions_warns(install_dists, caplog):
    one = _dist("twin", "1.0")
    other = FakeDistribution(
        "other-dist",
        "3.0",
        entry_points={GENERAL: {"twin": "other_mod:hello"}},
        modules={"other_mod.py": "def hello():\n    pass\n"},
    )
    install_dists(one, other)
    with caplog.at_level(logging.WARNING, logger="llmhal"):
        eps = plugins.discover(GENERAL)
    assert [ep.name for ep in eps].count("twin") == 1
    msg = next(r.getMessage() for r in caplog.records if "twin" in r.getMessage())
    assert "twin-dist 1.0" in msg and "other-dist 3.0" in msg


def test_unknown_group_is_rejected():
    with pytest.raises(ValueError, match="unknown plugin group"):
        plugins.load_plugins_by_group("vllm.nonsense")
