"""Fakes for the ROCm platform tests: an amdsmi module with configurable GPUs and failures.

The fake follows amdsmi's Python API (ROCm 6.x/7.x): ``amdsmi_init``/``amdsmi_shut_down``, processor
handles, ``amdsmi_get_gpu_asic_info`` (``market_name``, ``target_graphics_version`` such as
``"gfx942"``), byte-exact VRAM queries through ``AmdSmiMemoryType.VRAM`` (or, with ``old_api``, only
``amdsmi_get_gpu_vram_usage`` in MiB, as older releases had).
"""

from __future__ import annotations

import enum
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from llmhal_rocm.arch import arch_capability
from llmhal_rocm.detect import RocmDevice, RocmInventory, normalize_serial

GiB = 1 << 30
MiB = 1 << 20


@dataclass
class FakeAmdGpu:
    name: str
    arch: str
    total: int = 192 * GiB
    used: int = 2 * GiB
    uuid: str = ""  # amdsmi's dashed form, derived from the serial and the device id
    serial: str = ""  # asic_info["asic_serial"]; ROCr's GPU-<16 hex> names it


MI300X = FakeAmdGpu(
    "AMD Instinct MI300X",
    "gfx942",
    192 * GiB,
    1 * GiB,
    "4bff74a1-0000-1000-80f4-c2f6e9e2a4b1",
    "0x4B8A7E3A1C6D2F90",
)
MI355X = FakeAmdGpu(
    "AMD Instinct MI355X",
    "gfx950",
    288 * GiB,
    1 * GiB,
    "5cff74a1-0000-1000-80f4-c2f6e9e2a4b2",
    "0x5C9B8F4B2D7E3A01",
)
MI250X = FakeAmdGpu(
    "AMD Instinct MI250X",
    "gfx90a",
    64 * GiB,
    1 * GiB,
    "6dff74a1-0000-1000-80f4-c2f6e9e2a4b3",
    "0x6DAC905C3E8F4B12",
)
RX7900 = FakeAmdGpu(
    "Radeon RX 7900 XTX",
    "gfx1100",
    24 * GiB,
    1 * GiB,
    "7eff74a1-0000-1000-80f4-c2f6e9e2a4b4",
    "0x7EBDA16D4F905C23",
)
R9700 = FakeAmdGpu(
    "Radeon AI PRO R9700",
    "gfx1201",
    32 * GiB,
    1 * GiB,
    "8fff74a1-0000-1000-80f4-c2f6e9e2a4b5",
    "0x8FCEB27E50A16D34",
)


def make_fake_amdsmi(
    gpus: list[FakeAmdGpu],
    *,
    init_error: Exception | None = None,
    query_error: Exception | None = None,
    old_api: bool = False,
) -> types.ModuleType:
    m = types.ModuleType("amdsmi")

    class AmdSmiLibraryException(Exception):
        pass

    class AmdSmiMemoryType(enum.IntEnum):
        VRAM = 0
        VIS_VRAM = 1
        GTT = 2

    m.AmdSmiLibraryException = AmdSmiLibraryException
    m.calls = {"init": 0, "shutdown": 0}

    def amdsmi_init(flags: int = 0) -> None:
        if init_error is not None:
            raise init_error
        m.calls["init"] += 1

    def amdsmi_shut_down() -> None:
        m.calls["shutdown"] += 1

    def asic_info(h: FakeAmdGpu) -> dict[str, Any]:
        if query_error is not None:
            raise query_error
        return {
            "market_name": h.name,
            "target_graphics_version": h.arch,
            "vendor_id": "0x1002",
            "asic_serial": h.serial,
        }

    m.amdsmi_init = amdsmi_init
    m.amdsmi_shut_down = amdsmi_shut_down
    m.amdsmi_get_processor_handles = lambda: list(gpus)
    m.amdsmi_get_gpu_asic_info = asic_info
    m.amdsmi_get_gpu_device_uuid = lambda h: h.uuid
    m.amdsmi_get_gpu_driver_info = lambda h: {"driver_name": "amdgpu", "driver_version": "6.10.5"}
    m.amdsmi_get_gpu_vram_usage = lambda h: {
        "vram_total": h.total // MiB,
        "vram_used": h.used // MiB,
    }
    if not old_api:
        m.AmdSmiMemoryType = AmdSmiMemoryType
        m.amdsmi_get_gpu_memory_total = lambda h, t: h.total
        m.amdsmi_get_gpu_memory_usage = lambda h, t: h.used
    return m


@pytest.fixture
def rocm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clean environment: no visibility variables, no aiter opt-in, and no NVIDIA GPU detectable
    through NVML (so resolution tests see only the fake AMD GPUs)."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    for var in (
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "CUDA_VISIBLE_DEVICES",
        "VLLM_ROCM_USE_AITER",
        "LLMHAL_GPU_MEMORY_UTILIZATION",
        "VLLM_ATTENTION_BACKEND",
    ):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def install_amdsmi(
    monkeypatch: pytest.MonkeyPatch, rocm_env: None
) -> Callable[..., types.ModuleType | None]:
    """``install_amdsmi(gpus, ...)`` puts a fake amdsmi in sys.modules; ``install_amdsmi(None)``
    makes ``import amdsmi`` fail as if it were not installed."""

    def install(gpus: list[FakeAmdGpu] | None, **kw: Any) -> types.ModuleType | None:
        fake = None if gpus is None else make_fake_amdsmi(gpus, **kw)
        monkeypatch.setitem(sys.modules, "amdsmi", fake)
        return fake

    return install


def inventory(*gpus: FakeAmdGpu) -> RocmInventory:
    return RocmInventory(
        tuple(
            RocmDevice(
                i,
                g.name,
                g.uuid,
                g.arch,
                arch_capability(g.arch),
                g.total,
                normalize_serial(g.serial),
            )  # fmt: skip
            for i, g in enumerate(gpus)
        ),
        "6.10.5",
    )


@pytest.fixture
def fake_inventory() -> Callable[..., RocmInventory]:
    return inventory


@pytest.fixture
def gpus() -> types.SimpleNamespace:
    """The fake GPU models, by name (tests cannot import conftest under importlib mode)."""
    return types.SimpleNamespace(
        MI300X=MI300X, MI355X=MI355X, MI250X=MI250X, RX7900=RX7900, R9700=R9700
    )
