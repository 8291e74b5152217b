"""`llmhal doctor`: the report on this machine, and how it degrades when pieces are broken."""

from __future__ import annotations

import json
import os
from typing import Any, ClassVar

import pytest

import llmhal.platforms as platforms
from llmhal import doctor
from llmhal.platforms import DeviceCapability, Platform
from llmhal.quantization.base import QuantizationConfig
from llmhal.testing.distributions import run_cli
from llmhal.testing.isolation import fresh_plugin_state


@pytest.fixture(scope="module")
def cli_report() -> tuple[int, dict[str, Any], str]:
    # OpenMP choices unset, so the report shows the spin `import llmhal` picks whatever this machine sets
    quiet_omp = dict.fromkeys(("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"))
    proc = run_cli("doctor", "--json", env={"LLMHAL_LOGGING_LEVEL": "ERROR", **quiet_omp})
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def test_this_machine_runs_on_the_cpu_platform(cli_report):
    rc, report, stderr = cli_report
    assert rc == 0, stderr
    p = report["platform"]
    assert (p["name"], p["class"], p["selected_by"]) == (
        "cpu",
        "llmhal_cpu.platform:CpuPlatform",
        "probe",
    )
    assert p["reason"] and p["usable"] is True
    assert p["device"]["device_type"] == "cpu"


def test_first_party_accelerators_are_listed_as_unavailable_with_reasons(cli_report):
    _, report, _ = cli_report
    rows = {r["name"]: r for r in report["plugins"] if r["group"] == "vllm.platform_plugins"}
    cpu = rows["llmhal_cpu"]
    assert cpu["distribution"] == "llmhal-cpu" and cpu["status"] == "selected"
    for name, dist in (("llmhal_cuda", "llmhal-cuda"), ("llmhal_rocm", "llmhal-rocm")):
        assert rows[name]["distribution"] == dist and rows[name]["version"]
        assert rows[name]["status"] == "unavailable" and rows[name]["reason"]


def test_report_has_every_section_with_its_fields(cli_report):
    _, report, _ = cli_report
    fields = {
        "plugins": {"group", "name", "value", "distribution", "version", "status", "reason"},
        "attention_backends": {"name", "provider", "class_path", "available", "reasons"},
        "quantization_methods": {"name", "provider", "supported", "reasons"},
        "ops": {"name", "implementation", "source"},
        "structured_output_backends": {"name", "available", "reasons"},
        "tool_parsers": {"name", "class_path", "available", "reasons"},
        "reasoning_parsers": {"name", "class_path", "available", "reasons"},
    }
    for section, keys in fields.items():
        assert report[section], section
        for row in report[section]:
            assert keys <= set(row), (section, row)
    # the variables set for the run, and the OpenMP spin that `import llmhal` chose
    # (plus whatever the caller's shell set, e.g. LLMHAL_NUM_THREADS, shown as set)
    chosen = {"LLMHAL_LOGGING_LEVEL": "ERROR", "GOMP_SPINCOUNT": "2000"}
    inherited = {k: v for k, v in report["env"].items() if k not in chosen}
    assert {k: report["env"].get(k) for k in chosen} == chosen
    assert inherited == {k: os.environ[k] for k in inherited if k in os.environ}
    # a fresh process has made no selection; only the default model's would-be choice is listed
    assert [s for s in report["attention_selections"] if "model" not in s] == []
    backends = {b["name"]: b for b in report["attention_backends"]}
    assert backends["reference"]["available"] is True
    for b in report["attention_backends"]:
        assert b["available"] == (not b["reasons"])
        if b["provider"] in ("cuda", "rocm"):
            assert b["reasons"][0].startswith(
                f"provided by the {b['provider']} platform, which is not active here (unavailable: "
            )


def test_human_readable_output():
    proc = run_cli("doctor")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for heading in (
        "Platform: cpu",
        "Plugins (entry points):",
        "Attention backends:",
        "Quantization methods:",
        "Custom ops:",
        "Environment:",
        "Status: OK",
    ):
        assert heading in out, heading
    assert "llmhal-cuda" in out and "llmhal-rocm" in out


class _Sm70(Platform):
    name = "sm70"
    device_type = "cpu"
    priority = 10
    supported_quantization = ("needs_sm80", "ghost")

    def device_capability(self, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(7, 0)

    def mem_get_info(self, device_id: int = 0) -> tuple[int, int]:
        return 1 << 30, 2 << 30


class NeedsSm80(QuantizationConfig):
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}

    @classmethod
    def get_name(cls) -> str:
        return "needs_sm80"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[Any]:
        return []

    @classmethod
    def get_min_capability(cls) -> int:
        return 80

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> NeedsSm80:
        return cls()

    def get_quant_method(self, layer: Any, prefix: str) -> None:
        return None


def test_degrades_to_reasons_instead_of_crashing(tmp_path):
    from llmhal.attention.registry import register_attention_backend
    from llmhal.ops.registry import register_op_kernel
    from llmhal.quantization.registry import register_quantization_config_path

    with fresh_plugin_state(tmp_path):
        platforms.set_current_platform(_Sm70())
        register_attention_backend("broken_backend", "no_such_module_x:Backend")
        register_quantization_config_path("needs_sm80", f"{__name__}:NeedsSm80")
        register_quantization_config_path("ghost", "no_such_module_x:Ghost")
        register_op_kernel("silu_and_mul", "no_such_module_x:silu")
        report = doctor.collect()
        text = doctor.format_report(report)

    assert report["platform"]["selected_by"] == "set_current_platform"
    backends = {b["name"]: b for b in report["attention_backends"]}
    assert backends["broken_backend"]["available"] is False
    assert "cannot import no_such_module_x:Backend" in backends["broken_backend"]["reasons"][0]
    quant = {q["name"]: q for q in report["quantization_methods"]}
    assert quant["needs_sm80"]["reasons"] == ["needs device capability 8.0; this device is 7.0"]
    assert "cannot import no_such_module_x:Ghost" in quant["ghost"]["reasons"][0]
    assert any("not supported on the sm70 platform" in r for r in quant["awq"]["reasons"])
    ops = {o["name"]: o for o in report["ops"]}
    assert ops["silu_and_mul"]["source"] == "core"  # fell back, and says why
    assert "no_such_module_x:silu unavailable" in ops["silu_and_mul"]["note"]
    assert "broken_backend" in text and "needs device capability 8.0" in text


def test_a_broken_core_op_is_a_row_not_a_crash(tmp_path, monkeypatch):
    from llmhal.ops import registry

    with fresh_plugin_state(tmp_path):
        platforms.set_current_platform(_Sm70())  # a platform without kernels of its own
        monkeypatch.setitem(registry.CORE_OPS, "rms_norm", "no_such_module_x:rms_norm")
        rows = {o["name"]: o for o in doctor.collect()["ops"]}
    assert rows["rms_norm"]["implementation"] is None
    assert "ModuleNotFoundError" in rows["rms_norm"]["note"]
    assert rows["silu_and_mul"]["implementation"] == "llmhal.ops.native:silu_and_mul"


def test_recent_attention_selections_are_shown(tmp_path):
    import torch

    from llmhal.attention.backend import AttentionRequirements
    from llmhal.attention.selector import select_attention_backend

    with fresh_plugin_state(tmp_path):
        req = AttentionRequirements(head_size=64, num_heads=4, num_kv_heads=4, dtype=torch.float32)
        select_attention_backend(req, explicit="reference")
        selections = doctor.collect()["attention_selections"]
    assert selections[0] == {
        "name": "reference",
        "selected_by": "config",
        "reason": "attention_backend=reference",
        "requirements": req.describe(),
    }
    assert all("model" in s for s in selections[1:])  # then what the default model would get


def test_the_default_models_backend_is_shown(cli_report):
    _, report, _ = cli_report
    model = [s for s in report["attention_selections"] if "model" in s]
    assert len(model) == 1
    assert model[0]["model"].endswith(".gguf")
    assert (model[0]["name"], model[0]["selected_by"]) == ("cpu_attn", "priority")
    assert "head_size=64" in model[0]["requirements"]


def test_a_refused_explicit_backend_is_reported_for_the_default_model():
    proc = run_cli(
        "doctor",
        "--json",
        env={"VLLM_ATTENTION_BACKEND": "flash_attn", "LLMHAL_LOGGING_LEVEL": "ERROR"},
    )
    assert proc.returncode == 0, proc.stderr
    model = [s for s in json.loads(proc.stdout)["attention_selections"] if "model" in s][0]
    assert model["name"] is None
    assert "cuda platform" in model["reason"] and "cpu_attn" in model["reason"]


def test_structured_output_backends_say_what_to_install(monkeypatch):
    import llmhal.utils.imports as imports
    from llmhal.structured_output.manager import backend_status

    monkeypatch.setattr(imports, "is_available", lambda module: module != "xgrammar")
    rows = {r["name"]: r for r in backend_status()}
    assert rows["xgrammar"] == {"name": "xgrammar", "available": False,
                                "reasons": ["xgrammar is not installed (pip install xgrammar)"]}  # fmt: skip
    assert rows["guidance"]["available"] is True
    assert set(rows) == {"xgrammar", "guidance", "outlines", "lm-format-enforcer"}
