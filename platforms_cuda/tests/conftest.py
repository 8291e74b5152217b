"""Fakes for the CUDA platform tests: an NVML module with configurable GPUs and failures.

The fake follows pynvml's API (nvidia-ml-py): ``nvmlInit``/``nvmlShutdown``, device handles by
index, names and UUIDs as bytes (as pynvml < 11.5 returned them), memory records with
``total``/``free``/``used``, and the ``NVMLError`` hierarchy with ``NVMLError_LibraryNotFound``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from llmhal.platforms import DeviceCapability
from llmhal_cuda import detect
from llmhal_cuda.detect import NVML, CudaDevice, CudaInventory

GiB = 1 << 30


@dataclass
class FakeGpu:
    name: str
    capability: tuple[int, int]
    total: int = 80 * GiB
    free: int = 70 * GiB
    uuid: str = ""
    pci: str = ""  # NVML's busId
    mig: tuple[str, ...] = ()  # MIG instance UUIDs (MIG mode on when non-empty)


H100 = FakeGpu("NVIDIA H100 80GB HBM3", (9, 0), 80 * GiB, 79 * GiB, "GPU-11111111-aaaa")
A100 = FakeGpu("NVIDIA A100-SXM4-40GB", (8, 0), 40 * GiB, 39 * GiB, "GPU-22222222-bbbb")
B200 = FakeGpu("NVIDIA B200", (10, 0), 180 * GiB, 170 * GiB, "GPU-33333333-cccc")
T4 = FakeGpu("Tesla T4", (7, 5), 16 * GiB, 15 * GiB, "GPU-44444444-dddd")
L40S = FakeGpu("NVIDIA L40S", (8, 9), 48 * GiB, 47 * GiB, "GPU-55555555-eeee")


def make_fake_nvml(
    gpus: list[FakeGpu],
    *,
    init_error: str | None = None,
    query_error: Exception | None = None,
) -> types.ModuleType:
    """A module that behaves like pynvml on a host with ``gpus``.

    ``init_error``: "library" (libnvidia-ml.so missing) or "driver" (driver not loaded) makes
    ``nvmlInit`` raise that NVMLError. ``query_error`` is raised by ``nvmlDeviceGetName``.
    """
    m = types.ModuleType("pynvml")
    m.NVML_ERROR_DRIVER_NOT_LOADED = 9
    m.NVML_ERROR_LIBRARY_NOT_FOUND = 12

    class NVMLError(Exception):
        messages = {9: "Driver Not Loaded", 12: "NVML Shared Library Not Found"}

        def __init__(self, value: int) -> None:
            super().__init__(value)
            self.value = value

        def __str__(self) -> str:
            return self.messages.get(self.value, f"NVML error {self.value}")

    class NVMLError_LibraryNotFound(NVMLError):
        def __init__(self) -> None:
            super().__init__(12)

    class NVMLError_DriverNotLoaded(NVMLError):
        def __init__(self) -> None:
            super().__init__(9)

    m.NVMLError = NVMLError
    m.NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    m.NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    m.calls = {"init": 0, "shutdown": 0}

    def nvmlInit() -> None:
        if init_error == "library":
            raise NVMLError_LibraryNotFound()
        if init_error == "driver":
            raise NVMLError_DriverNotLoaded()
        m.calls["init"] += 1

    def nvmlShutdown() -> None:
        m.calls["shutdown"] += 1

    def handle(i: int) -> FakeGpu:
        if m.calls["init"] <= m.calls["shutdown"]:
            raise NVMLError(1)  # uninitialised
        return gpus[i]

    def get_name(h: FakeGpu) -> bytes:
        if query_error is not None:
            raise query_error
        return h.name.encode()

    m.nvmlInit = nvmlInit
    m.nvmlShutdown = nvmlShutdown
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlDeviceGetName = get_name
    m.nvmlDeviceGetUUID = lambda h: h.uuid.encode()
    m.nvmlDeviceGetCudaComputeCapability = lambda h: h.capability
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=h.total, free=h.free, used=h.total - h.free
    )
    m.nvmlSystemGetDriverVersion = lambda: b"570.86.15"
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=h.pci.encode())
    m.NVML_DEVICE_MIG_ENABLE = 1
    m.nvmlDeviceGetMigMode = lambda h: [1 if h.mig else 0, 1 if h.mig else 0]
    m.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7

    def mig_handle(h: FakeGpu, i: int) -> FakeGpu:
        if i >= len(h.mig):
            raise NVMLError(6)  # NVML_ERROR_NOT_FOUND
        return FakeGpu(h.name + " MIG", h.capability, h.total // 7, h.free // 7, h.mig[i])

    m.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle
    return m


@pytest.fixture
def cuda_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[Any]:
    """A clean environment: no CUDA_VISIBLE_DEVICES, Jetson markers pointing at nothing, and no AMD
    GPU detectable (so resolution tests see only the fake NVIDIA GPUs, on any host)."""
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    for var in ("CUDA_VISIBLE_DEVICES", "LLMHAL_GPU_MEMORY_UTILIZATION", "VLLM_ATTENTION_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(detect, "JETSON_MARKERS", (str(tmp_path / "no_tegra"),))
    yield tmp_path


@pytest.fixture
def install_nvml(
    monkeypatch: pytest.MonkeyPatch, cuda_env: Any
) -> Callable[..., types.ModuleType | None]:
    """``install_nvml(gpus, ...)`` puts a fake pynvml in sys.modules; ``install_nvml(None)`` makes
    ``import pynvml`` fail as if nvidia-ml-py were not installed."""

    def install(gpus: list[FakeGpu] | None, **kw: Any) -> types.ModuleType | None:
        fake = None if gpus is None else make_fake_nvml(gpus, **kw)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake

    return install


def inventory(*gpus: FakeGpu) -> CudaInventory:
    """What NVML detection would report for ``gpus`` (for platforms built without NVML calls)."""
    return CudaInventory(
        NVML,
        tuple(
            CudaDevice(i, g.name, g.uuid, DeviceCapability(*g.capability), g.total, g.pci, g.mig)
            for i, g in enumerate(gpus)
        ),
        "570.86.15",
    )


@pytest.fixture
def fake_inventory() -> Callable[..., CudaInventory]:
    return inventory


@pytest.fixture
def gpus() -> types.SimpleNamespace:
    """The fake GPU models, by name (tests cannot import conftest under importlib mode)."""
    return types.SimpleNamespace(H100=H100, A100=A100, B200=B200, T4=T4, L40S=L40S)
