"""RocmPlatform: amdsmi detection through fakes, gfx arch -> capability, visibility, fp8 formats,
priorities, and the shared platform-contract conformance suite."""

from __future__ import annotations

import json

import pytest
import torch

from llmhal.attention.backend import AttentionRequirements
from llmhal.platforms import DeviceCapability, PlatformUnavailable
from llmhal.platforms.resolver import UNAVAILABLE, resolve
from llmhal.testing.platform_conformance import (
    check_contributions,
    check_platform_class,
    check_platform_instance,
    check_probe,
)
from llmhal_rocm import detect, rocm_platform_plugin
from llmhal_rocm.arch import arch_capability, is_fp8_fnuz, normalize_arch
from llmhal_rocm.detect import detect_rocm
from llmhal_rocm.platform import RocmPlatform
from llmhal_rocm.visibility import visible_devices


# ------------------------------------------------------------------------------- arch names
@pytest.mark.parametrize(
    ("name", "cap"),
    [
        ("gfx906", (9, 0)),
        ("gfx908", (9, 0)),
        ("gfx90a", (9, 0)),
        ("gfx942", (9, 4)),
        ("gfx950", (9, 5)),
        ("gfx1030", (10, 3)),
        ("gfx1100", (11, 0)),
        ("gfx1101", (11, 0)),
        ("gfx1201", (12, 0)),
        ("gfx942:sramecc+:xnack-", (9, 4)),
        ("GFX90A", (9, 0)),
    ],
)
def test_arch_capability(name, cap):
    assert arch_capability(name) == DeviceCapability(*cap)


@pytest.mark.parametrize("bad", ["", "gfx", "sm_90", "gfx9g2", "942"])
def test_arch_capability_rejects_other_names(bad):
    with pytest.raises(ValueError, match="not an AMD GPU architecture name"):
        arch_capability(bad)


def test_fnuz_only_on_cdna3():
    assert [a for a in ("gfx90a", "gfx940", "gfx942", "gfx950", "gfx1201") if is_fp8_fnuz(a)] == [
        "gfx940",
        "gfx942",
    ]
    assert normalize_arch("gfx942:xnack+") == "gfx942"


# -------------------------------------------------------------------------------- detection
def test_amdsmi_reports_every_gpu(install_amdsmi, gpus):
    smi = install_amdsmi([gpus.MI300X, gpus.RX7900])
    inv = detect_rocm()
    assert [(d.name, d.arch, d.capability) for d in inv.devices] == [
        (gpus.MI300X.name, "gfx942", (9, 4)),
        (gpus.RX7900.name, "gfx1100", (11, 0)),
    ]
    assert inv.devices[0].total_memory == gpus.MI300X.total
    assert inv.driver_version == "6.10.5"
    assert smi.calls["init"] == smi.calls["shutdown"] == 1


def test_old_amdsmi_memory_in_mib(install_amdsmi, gpus):
    install_amdsmi([gpus.MI250X], old_api=True)
    assert detect_rocm().devices[0].total_memory == gpus.MI250X.total


def test_not_installed(install_amdsmi):
    install_amdsmi(None)
    with pytest.raises(PlatformUnavailable, match="amdsmi is not installed"):
        detect_rocm()


def test_library_missing_raises_keyerror_at_import(rocm_env, monkeypatch):
    # amdsmi's package raises KeyError at import when libamd_smi.so is missing.
    def broken():
        raise KeyError("ROCM_PATH")

    monkeypatch.setattr(detect, "import_amdsmi", broken)
    with pytest.raises(
        PlatformUnavailable, match=r"cannot load its library \(KeyError: 'ROCM_PATH'\)"
    ):
        detect_rocm()


def test_init_failure(install_amdsmi, gpus):
    install_amdsmi([gpus.MI300X], init_error=RuntimeError("AMDSMI_STATUS_DRIVER_NOT_LOADED"))
    with pytest.raises(
        PlatformUnavailable, match="amdsmi failed to initialise: .*DRIVER_NOT_LOADED"
    ):
        detect_rocm()


def test_zero_devices(install_amdsmi):
    smi = install_amdsmi([])
    with pytest.raises(PlatformUnavailable, match="amdsmi found no AMD GPU"):
        detect_rocm()
    assert smi.calls["shutdown"] == 1


def test_query_failure(install_amdsmi, gpus):
    smi = install_amdsmi([gpus.MI300X], query_error=OSError("device busy"))
    with pytest.raises(PlatformUnavailable, match="amdsmi query failed: OSError: device busy"):
        detect_rocm()
    assert smi.calls["shutdown"] == 1


def test_probe_outside_llmhal_and_resolution(install_amdsmi, gpus):
    install_amdsmi([gpus.MI300X])
    assert rocm_platform_plugin() is None
    platform, selection = resolve()
    assert isinstance(platform, RocmPlatform) and selection.name == "rocm"
    assert platform.gcn_arch() == "gfx942"


@pytest.mark.parametrize(
    ("names", "env", "reason"),
    [
        (None, {}, "amdsmi is not installed"),
        ([], {}, "amdsmi found no AMD GPU"),
        (["MI300X"], {"HIP_VISIBLE_DEVICES": ""}, "hide all 1 AMD GPU(s)"),
        (["MI300X"], {"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1"}, "disagree"),
    ],
)
def test_resolution_records_why_rocm_is_unavailable(
    install_amdsmi, gpus, monkeypatch, names, env, reason
):
    install_amdsmi(None if names is None else [getattr(gpus, n) for n in names])
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    platform, selection = resolve()
    assert not isinstance(platform, RocmPlatform)
    result = next(p for p in selection.probes if p.platform == "rocm")
    assert result.status == UNAVAILABLE and reason in result.reason


# ------------------------------------------------------------------------------- visibility
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, [0, 1, 2]),
        ({"HIP_VISIBLE_DEVICES": "2,0"}, [2, 0]),
        ({"CUDA_VISIBLE_DEVICES": "1"}, [1]),
        ({"ROCR_VISIBLE_DEVICES": "1,2", "HIP_VISIBLE_DEVICES": "1"}, [2]),
        # ROCr names a GPU by its ASIC serial (rocminfo's Uuid), not amdsmi's dashed UUID.
        ({"ROCR_VISIBLE_DEVICES": "GPU-5c9b8f4b2d7e3a01"}, [1]),
        ({"ROCR_VISIBLE_DEVICES": "GPU-6DAC905C3E8F4B12,GPU-4b8a7e3a1c6d2f90"}, [2, 0]),
        ({"ROCR_VISIBLE_DEVICES": "GPU-5cff74a1-0000-1000-80f4-c2f6e9e2a4b2"}, []),
        ({"HIP_VISIBLE_DEVICES": "0,5,1"}, [0]),
        ({"HIP_VISIBLE_DEVICES": "0,0"}, [0]),
        ({"ROCR_VISIBLE_DEVICES": ""}, []),
    ],
)
def test_visible_devices(gpus, fake_inventory, env, expected):
    devices = fake_inventory(gpus.MI300X, gpus.MI355X, gpus.MI250X).devices
    assert [d.index for d in visible_devices(devices, env)] == expected


def test_hip_and_cuda_lists_must_agree(gpus, fake_inventory):
    devices = fake_inventory(gpus.MI300X).devices
    with pytest.raises(ValueError, match="disagree"):
        visible_devices(devices, {"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1"})
    assert (
        len(visible_devices(devices, {"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "0"}))
        == 1
    )


def test_platform_maps_logical_to_physical(rocm_env, gpus, fake_inventory, monkeypatch):
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    p = RocmPlatform(fake_inventory(gpus.MI300X, gpus.MI355X))
    assert p.device_count() == 1 and p.physical_device_id(0) == 1
    assert p.gcn_arch() == "gfx950" and p.device_capability() == DeviceCapability(9, 5)
    with pytest.raises(IndexError, match="ROCm device 1 does not exist: 1 visible"):
        p.get_device_name(1)


# ----------------------------------------------------------------------------- capabilities
@pytest.mark.parametrize(
    ("model", "fnuz", "fp8", "fast_bf16"),
    [
        ("MI300X", True, True, True),
        ("MI355X", False, True, True),
        ("MI250X", False, False, True),
        ("RX7900", False, False, True),
        ("R9700", False, True, True),
    ],
)
def test_capabilities_by_arch(rocm_env, gpus, fake_inventory, model, fnuz, fp8, fast_bf16):
    p = RocmPlatform(fake_inventory(getattr(gpus, model)))
    caps = p.capabilities
    assert caps.extra["fp8_fnuz"] is fnuz and p.is_fp8_fnuz() is fnuz
    assert caps.extra["fp8_dtype"] == ("float8_e4m3fnuz" if fnuz else "float8_e4m3fn")
    assert p.fp8_dtype() == (torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn)
    assert caps.fp8_compute is fp8 and caps.fast_bf16_matmul is fast_bf16
    assert caps.bf16 and caps.fp16 and caps.graphs and caps.fp8_storage
    assert p.supported_dtypes == (torch.bfloat16, torch.float16, torch.float32)


def test_mixed_archs_need_the_feature_on_every_device(rocm_env, gpus, fake_inventory):
    caps = RocmPlatform(fake_inventory(gpus.MI300X, gpus.MI250X)).capabilities
    assert not caps.fp8_compute and not caps.extra["fp8_fnuz"]
    assert caps.extra["gcn_arch"] == "gfx90a,gfx942"


def test_identity_and_quantization_allow_list(rocm_env, gpus, fake_inventory):
    assert RocmPlatform.name == "rocm" and RocmPlatform.device_type == "cuda"
    assert RocmPlatform.dist_backend == "nccl"
    assert RocmPlatform.device_control_env_var == "HIP_VISIBLE_DEVICES"
    assert RocmPlatform.priority > 0 and not RocmPlatform.is_fallback
    p = RocmPlatform(fake_inventory(gpus.MI300X))
    for ok in ("gguf", "fp8", "compressed-tensors", "gptq", "awq", "bitsandbytes"):
        p.verify_quantization(ok)
    with pytest.raises(ValueError, match="'gptq_marlin' is not supported on the rocm platform"):
        p.verify_quantization("gptq_marlin")


# ----------------------------------------------------------------------------------- memory
def test_memory_from_amdsmi(install_amdsmi, gpus, monkeypatch):
    install_amdsmi([gpus.MI300X, gpus.MI355X])
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    p = RocmPlatform()
    free = gpus.MI355X.total - gpus.MI355X.used
    assert p.mem_get_info() == (free, gpus.MI355X.total)
    assert p.kv_cache_memory_budget(1 << 30) == int(free * 0.9)
    monkeypatch.setenv("LLMHAL_GPU_MEMORY_UTILIZATION", "0.25")
    assert p.kv_cache_memory_budget(0) == int(free * 0.25)


# ------------------------------------------------------------------------------- priorities
def _req(kind="mha") -> AttentionRequirements:
    return AttentionRequirements(64, 8, 2, torch.bfloat16, kind=kind)


def test_priority_and_the_aiter_opt_in(rocm_env, gpus, fake_inventory, monkeypatch):
    p = RocmPlatform(fake_inventory(gpus.MI300X))
    assert p.attention_backend_priority(_req()) == ["rocm_attn", "triton_attn", "flex_attention"]
    assert p.attention_backend_priority(_req("tree")) == ["tree_attn"]
    monkeypatch.setenv("VLLM_ROCM_USE_AITER", "1")
    assert p.attention_backend_priority(_req())[:2] == ["rocm_aiter_fa", "rocm_attn"]


def test_describe_is_json(rocm_env, gpus, fake_inventory):
    info = RocmPlatform(fake_inventory(gpus.MI300X, gpus.MI355X)).describe()
    json.dumps(info)
    assert [d["arch"] for d in info["devices"]] == ["gfx942", "gfx950"]
    assert info["device_capability"] == "9.4"


# ------------------------------------------------------------------------------ conformance
def test_conformance_class_probe_and_contributions():
    assert check_platform_class(RocmPlatform) == []
    assert check_probe(rocm_platform_plugin, RocmPlatform) == []
    report = check_contributions(RocmPlatform)
    assert report.problems == []
    assert not [s for s in report.skipped if "attention backend" in s]


def test_conformance_instance_on_fake_amdsmi(install_amdsmi, gpus):
    install_amdsmi([gpus.MI300X])
    problems = check_platform_instance(RocmPlatform())
    if not torch.cuda.is_available():
        # Seeding/set_device/synchronize need a real device; everything else runs on the fakes.
        problems = [p for p in problems if not p.startswith("device_control:")]
    assert problems == []


def test_rocr_uuids_match_the_serial_amdsmi_reports(install_amdsmi, gpus):
    install_amdsmi([gpus.MI300X, gpus.MI355X])
    devices = detect_rocm().devices
    assert [d.serial for d in devices] == ["4b8a7e3a1c6d2f90", "5c9b8f4b2d7e3a01"]
    env = {"ROCR_VISIBLE_DEVICES": "GPU-5C9B8F4B2D7E3A01"}  # rocminfo's "Uuid:" line
    assert [d.index for d in visible_devices(devices, env)] == [1]
