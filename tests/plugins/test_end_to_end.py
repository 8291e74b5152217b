"""The fake out-of-tree vendor ``fakenpu``, installed beside the real packages, in fresh processes."""

from __future__ import annotations

import json

import pytest

from llmhal.testing.distributions import (
    FakeDistribution,
    build_distributions,
    marker_count,
    run_cli,
    run_python,
)
from llmhal.testing.fake_vendor import GENERAL, REGISTER_RAN_MARKER, fakenpu_distribution

FAKENPU_ENTRIES = {
    ("vllm.platform_plugins", "fakenpu"),
    ("vllm.general_plugins", "fakenpu_hooks"),
    ("vllm.general_plugins", "fakenpu_register"),
    ("vllm.io_processor_plugins", "fakenpu_io"),
    ("vllm.stat_logger_plugins", "fakenpu_stats"),
}

DOCTOR_AND_MODELS = """
import json
from llmhal.doctor import collect
from llmhal.models.registry import ModelRegistry

report = collect()
report["models"] = ModelRegistry.get_supported_archs()
print(json.dumps(report, default=str))
"""


@pytest.fixture
def fakenpu(tmp_path):
    return build_distributions(tmp_path / "dists", fakenpu_distribution())


@pytest.fixture
def marker_dir(tmp_path):
    folder = tmp_path / "markers"
    folder.mkdir()
    return folder


def _json(proc) -> dict:
    assert proc.stdout, proc.stderr
    return json.loads(proc.stdout)


def test_fake_vendor_uses_every_group(fakenpu, marker_dir):
    proc = run_python(DOCTOR_AND_MODELS, path=[fakenpu], marker_dir=marker_dir)
    assert proc.returncode == 0, proc.stderr
    report = _json(proc)

    platform = report["platform"]
    assert (platform["name"], platform["selected_by"]) == ("fakenpu", "probe")
    assert platform["class"] == "fakenpu.platform:FakenpuPlatform"
    assert "cpu (priority 0)" in platform["reason"]

    rows = {(p["group"], p["name"]): p for p in report["plugins"]}
    assert FAKENPU_ENTRIES <= set(rows)
    for key in FAKENPU_ENTRIES:
        assert (rows[key]["distribution"], rows[key]["version"]) == ("fakenpu", "0.3.1")
    assert rows[("vllm.platform_plugins", "fakenpu")]["status"] == "selected"
    assert rows[("vllm.platform_plugins", "llmhal_cpu")]["status"] == "available"
    assert rows[("vllm.general_plugins", "fakenpu_hooks")]["status"] == "loaded"
    assert rows[("vllm.io_processor_plugins", "fakenpu_io")]["value"] == (
        "fakenpu.io:io_processor_plugin"
    )

    # The hook module registered a model, an attention backend and an op kernel.
    assert "FakeNpuForCausalLM" in report["models"]
    backends = {b["name"]: b for b in report["attention_backends"]}
    assert backends["fakenpu_attn"]["provider"] == "fakenpu"
    assert backends["fakenpu_attn"]["available"] is True
    assert backends["fakenpu_paged"]["provider"] == "registered"
    assert backends["fakenpu_paged"]["available"] is True
    assert backends["flash_attn"]["available"] is False
    assert "provided by the cuda platform" in backends["flash_attn"]["reasons"][0]
    ops = {o["name"]: o for o in report["ops"]}
    assert ops["rms_norm"]["implementation"] == "fakenpu.ops:rms_norm"
    assert ops["rms_norm"]["source"] == "registered"

    # The platform's quantization allow-list (gguf, fp8) is applied.
    quant = {q["name"]: q for q in report["quantization_methods"]}
    assert quant["awq"]["supported"] is False
    assert any("not supported on the fakenpu platform" in r for r in quant["awq"]["reasons"])
    assert marker_count(marker_dir, REGISTER_RAN_MARKER) == 1
    assert report["errors"] == []


def test_empty_allow_list_loads_nothing_and_doctor_blames_it(fakenpu, marker_dir):
    proc = run_cli(
        "doctor", "--json", path=[fakenpu], env={"VLLM_PLUGINS": ""}, marker_dir=marker_dir
    )
    assert proc.returncode != 0
    report = _json(proc)
    assert report["platform"]["name"] == "unspecified"
    assert report["platform"]["selected_by"] == "none"
    assert "VLLM_PLUGINS=''" in report["platform"]["reason"]
    assert "VLLM_PLUGINS=fakenpu,llmhal_cpu" in report["platform"]["reason"]
    assert {p["status"] for p in report["plugins"]} == {"not allowed"}
    assert list(marker_dir.iterdir()) == []  # not a single fakenpu module ran


def test_allow_list_names_the_platform_and_warns_about_unknown_names(fakenpu, marker_dir):
    code = """
    import sys
    import llmhal.platforms as platforms
    from llmhal.plugins import load_general_plugins

    load_general_plugins()
    print(platforms.current_platform.name)
    print("llmhal_cuda" in sys.modules, "llmhal_rocm" in sys.modules)
    """
    env = {"VLLM_PLUGINS": " llmhal_cpu , fakenpu_register,bogus,cuda "}
    proc = run_python(code, path=[fakenpu], env=env, marker_dir=marker_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["cpu", "False", "False"]
    assert "VLLM_PLUGINS" in proc.stderr and "'bogus'" in proc.stderr
    # VLLM_PLUGINS matches entry-point names (never imports a module to learn a platform's name),
    # so a platform's name is pointed to its entry point.
    assert "'cuda', but no installed plugin has that name (did you mean 'llmhal_cuda'?)" in (
        proc.stderr
    )
    assert marker_count(marker_dir, REGISTER_RAN_MARKER) == 1
    for never in ("fakenpu.hooks", "fakenpu.platform", "fakenpu.io", "fakenpu.stats"):
        assert marker_count(marker_dir, never) == 0, never


def test_general_plugin_runs_once_per_process_from_two_threads(fakenpu, marker_dir):
    code = """
    import threading
    from llmhal.plugins import load_general_plugins

    barrier = threading.Barrier(2)

    def go():
        barrier.wait()
        load_general_plugins()

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    """
    proc = run_python(code, path=[fakenpu], marker_dir=marker_dir)
    assert proc.returncode == 0, proc.stderr
    assert marker_count(marker_dir, REGISTER_RAN_MARKER) == 1
    assert marker_count(marker_dir, "fakenpu.hooks") == 1


def test_failing_explicit_general_plugin_is_an_error(tmp_path):
    broken = FakeDistribution(
        "broken-vendor",
        "4.5",
        entry_points={GENERAL: {"broken": "broken_vendor:register"}},
        modules={"broken_vendor.py": "def register():\n    raise OSError('no /dev/npu0')\n"},
    )
    root = build_distributions(tmp_path / "dists", broken)
    code = "from llmhal.plugins import load_general_plugins\nload_general_plugins()\n"

    quiet = run_python(code, path=[root])  # not asked for: logged and recorded, not fatal
    assert quiet.returncode == 0
    assert "broken-vendor 4.5" in quiet.stderr and "no /dev/npu0" in quiet.stderr

    loud = run_python(code, path=[root], env={"VLLM_PLUGINS": "llmhal_cpu,broken"})
    assert loud.returncode != 0
    assert "PluginLoadError" in loud.stderr and "broken-vendor 4.5" in loud.stderr

    doctor = run_cli("doctor", "--json", path=[root], env={"VLLM_PLUGINS": "llmhal_cpu,broken"})
    report = _json(doctor)
    assert any("broken-vendor 4.5" in e for e in report["errors"])
    row = next(p for p in report["plugins"] if p["name"] == "broken")
    assert row["status"] == "failed" and "no /dev/npu0" in row["reason"]
