"""CUDA detection through (fake) NVML: present, absent, zero devices, failures, Jetson fallback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmhal.platforms import DeviceCapability, PlatformUnavailable
from llmhal.platforms.resolver import AVAILABLE, SELECTED, UNAVAILABLE, resolve
from llmhal_cuda import cuda_platform_plugin, detect
from llmhal_cuda.detect import JETSON, NVML, detect_cuda
from llmhal_cuda.platform import CudaPlatform


def test_nvml_reports_every_gpu_and_shuts_down(gpus, install_nvml):
    nvml = install_nvml([gpus.H100, gpus.A100])
    inv = detect_cuda()
    assert inv.source == NVML
    assert inv.driver_version == "570.86.15"
    assert [d.name for d in inv.devices] == [gpus.H100.name, gpus.A100.name]  # bytes decoded
    assert [d.capability for d in inv.devices] == [DeviceCapability(9, 0), DeviceCapability(8, 0)]
    assert [d.total_memory for d in inv.devices] == [gpus.H100.total, gpus.A100.total]
    assert inv.devices[1].uuid == gpus.A100.uuid
    assert nvml.calls["init"] == nvml.calls["shutdown"] == 1


def test_missing_binding_without_jetson_names_the_package(install_nvml):
    install_nvml(None)
    with pytest.raises(PlatformUnavailable, match=r"pip install nvidia-ml-py"):
        detect_cuda()


def test_missing_library_without_jetson(gpus, install_nvml):
    install_nvml([gpus.H100], init_error="library")
    with pytest.raises(PlatformUnavailable, match="NVML library not found"):
        detect_cuda()


@pytest.mark.parametrize("how", ["binding", "library"])
def test_jetson_fallback(install_nvml, cuda_env, monkeypatch, how):
    marker = cuda_env / "nv_tegra_release"
    marker.write_text("# R36 (release), REVISION: 3.0\n")
    monkeypatch.setattr(detect, "JETSON_MARKERS", (str(cuda_env / "missing"), str(marker)))
    install_nvml(None) if how == "binding" else install_nvml([], init_error="library")
    inv = detect_cuda()
    assert inv.source == JETSON
    assert inv.jetson_marker == str(marker)
    assert inv.devices == ()


def test_driver_failure_is_quoted_not_treated_as_jetson(gpus, install_nvml, cuda_env, monkeypatch):
    marker = cuda_env / "tegra-firmware"
    marker.mkdir()
    monkeypatch.setattr(detect, "JETSON_MARKERS", (str(marker),))
    install_nvml([gpus.H100], init_error="driver")
    with pytest.raises(
        PlatformUnavailable, match=r"NVML failed to initialise: .*Driver Not Loaded"
    ):
        detect_cuda()


def test_zero_devices(install_nvml):
    nvml = install_nvml([])
    with pytest.raises(PlatformUnavailable, match="NVML found no NVIDIA GPU"):
        detect_cuda()
    assert nvml.calls["shutdown"] == 1


def test_query_failure_is_reported_and_nvml_shut_down(gpus, install_nvml):
    nvml = install_nvml([gpus.H100], query_error=RuntimeError("GPU is lost"))
    with pytest.raises(PlatformUnavailable, match="NVML query failed: RuntimeError: GPU is lost"):
        detect_cuda()
    assert nvml.calls["init"] == nvml.calls["shutdown"] == 1


def test_probe_returns_none_outside_llmhal(gpus, install_nvml):
    install_nvml([gpus.H100])
    assert cuda_platform_plugin() is None
    assert cuda_platform_plugin.llmhal_platform_class == "llmhal_cuda.platform:CudaPlatform"


def _cuda_result(selection):
    return next(p for p in selection.probes if p.platform == "cuda")


def test_resolution_selects_cuda_over_cpu(gpus, install_nvml):
    install_nvml([gpus.H100, gpus.A100])
    platform, selection = resolve()
    assert isinstance(platform, CudaPlatform)
    assert selection.name == "cuda"
    assert _cuda_result(selection).status in (AVAILABLE, SELECTED)
    # The instance made by the resolver detects lazily, through the same NVML.
    assert platform.device_count() == 2
    assert platform.get_device_name(1) == gpus.A100.name


@pytest.mark.parametrize(
    ("names", "kw", "env", "reason"),
    [
        (None, {}, None, "nvidia-ml-py"),
        ([], {}, None, "NVML found no NVIDIA GPU"),
        (["H100"], {"init_error": "driver"}, None, "Driver Not Loaded"),
        (["H100", "A100"], {}, "", "CUDA_VISIBLE_DEVICES='' hides all 2 NVIDIA GPU(s)"),
        (["H100"], {}, "3", "CUDA_VISIBLE_DEVICES='3' hides all 1 NVIDIA GPU(s)"),
    ],
)
def test_resolution_records_why_cuda_is_unavailable(
    install_nvml, monkeypatch, gpus, names, kw, env, reason
):
    install_nvml(None if names is None else [getattr(gpus, n) for n in names], **kw)
    if env is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    platform, selection = resolve()
    assert not isinstance(platform, CudaPlatform)
    result = _cuda_result(selection)
    assert result.status == UNAVAILABLE
    assert reason in result.reason


def test_probe_and_platform_do_not_import_torch(tmp_path):
    fake = tmp_path / "pynvml.py"
    fake.write_text(
        "class NVMLError(Exception):\n    pass\n"
        "def nvmlInit(): pass\ndef nvmlShutdown(): pass\n"
        "def nvmlDeviceGetCount(): return 1\ndef nvmlDeviceGetHandleByIndex(i): return i\n"
        "def nvmlDeviceGetName(h): return b'NVIDIA A100'\ndef nvmlDeviceGetUUID(h): return b'GPU-0'\n"
        "def nvmlDeviceGetCudaComputeCapability(h): return (8, 0)\n"
        "class _M:\n    total, free, used = 1 << 30, 1 << 29, 1 << 29\n"
        "def nvmlDeviceGetMemoryInfo(h): return _M()\n"
        "def nvmlSystemGetDriverVersion(): return b'570'\n"
    )
    code = (
        "import sys\n"
        "from llmhal.platforms import get_current_platform\n"
        "p = get_current_platform()\n"
        "print(p.name, p.device_count(), tuple(p.device_capability()), p.mem_get_info()[0], "
        "'torch' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLATFORM", "VLLM_PLUGINS")}
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cuda", "1", "(8,", "0)", str(1 << 29), "False"]
