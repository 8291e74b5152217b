"""The Platform contract's own behaviour (no resolution involved)."""

from __future__ import annotations

import pytest
import torch

from llmhal.platforms import (
    DeviceCapability,
    Platform,
    PlatformCapabilities,
    PlatformNotUsableError,
    UnspecifiedPlatform,
    platform_probe,
)


class _Gpu(Platform):
    name = "gpu"
    device_type = "cpu"
    device_control_env_var = "GPU_VISIBLE_DEVICES"
    supported_quantization = ("fp8", "gguf")

    def device_capability(self, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(8, 6)

    @property
    def capabilities(self) -> PlatformCapabilities:
        return PlatformCapabilities(bf16=False)


def test_device_capability_forms():
    cap = DeviceCapability(9, 0)
    assert cap.as_version_str() == "9.0" and cap.to_int() == 90
    with pytest.raises(ValueError, match="minor version 12"):
        DeviceCapability(10, 12).to_int()


def test_has_device_capability_accepts_tuples_and_ints():
    gpu = _Gpu()
    assert gpu.has_device_capability((8, 0)) and gpu.has_device_capability(86)
    assert not gpu.has_device_capability((8, 9)) and not gpu.has_device_capability(90)
    assert not Platform().has_device_capability((0, 0))  # no capability notion at all


def test_physical_device_id_follows_the_visibility_variable(monkeypatch):
    gpu = _Gpu()
    monkeypatch.delenv("GPU_VISIBLE_DEVICES", raising=False)
    assert gpu.physical_device_id(1) == 1
    monkeypatch.setenv("GPU_VISIBLE_DEVICES", "3, 1")
    assert gpu.physical_device_id(0) == 3 and gpu.physical_device_id(1) == 1
    with pytest.raises(IndexError, match="GPU_VISIBLE_DEVICES"):
        gpu.physical_device_id(2)


def test_supported_dtypes_follow_capabilities():
    assert _Gpu().supported_dtypes == (torch.float16, torch.float32)
    assert Platform().supported_dtypes == (torch.bfloat16, torch.float16, torch.float32)


def test_verify_dtype_names_the_alternatives():
    with pytest.raises(ValueError) as err:
        _Gpu().verify_dtype(torch.bfloat16)
    assert "bfloat16" in str(err.value) and "float16, float32" in str(err.value)


def test_verify_quantization_names_what_is_supported():
    gpu = _Gpu()
    gpu.verify_quantization("fp8")
    with pytest.raises(ValueError) as err:
        gpu.verify_quantization("awq")
    assert "'awq'" in str(err.value) and "fp8, gguf" in str(err.value)
    Platform().verify_quantization("anything")  # None allows every method


def test_default_kv_cache_budget_keeps_headroom():
    class _Mem(_Gpu):
        def mem_get_info(self, device_id: int = 0) -> tuple[int, int]:
            return 1000, 2000

    assert _Mem().kv_cache_memory_budget(100) == 800
    assert _Mem().kv_cache_memory_budget(5000) == 0


def test_unspecified_platform_says_what_to_install():
    p = UnspecifiedPlatform("nothing installed")
    for call in (
        p.mem_get_info,
        p.get_device_total_memory,
        p.torch_device,
        lambda: p.supported_dtypes,
        lambda: p.check_and_update_config(None),
    ):
        with pytest.raises(PlatformNotUsableError) as err:
            call()
        assert "pip install llmhal[cpu]" in str(err.value) and "nothing installed" in str(err.value)
    assert p.device_count() == 0
    assert p.describe() == {
        "name": "unspecified",
        "device_name": "no platform",
        "reason": "nothing installed",
    }


def test_platform_probe_declares_the_class_and_keeps_the_function():
    @platform_probe("pkg.mod:Cls")
    def probe() -> str:
        return "pkg.mod:Cls"

    assert probe.llmhal_platform_class == "pkg.mod:Cls" and probe() == "pkg.mod:Cls"


def test_describe_is_plain_data():
    info = _Gpu().describe()
    assert info["device_capability"] == "8.6"
    assert info["supported_dtypes"] == ["float16", "float32"]
    assert info["capabilities"]["bf16"] is False


def test_cpu_architecture_is_one_of_the_known_names():
    assert Platform.cpu_architecture() in {
        "x86",
        "arm",
        "powerpc",
        "s390x",
        "riscv",
        "other",
        "unknown",
    }
