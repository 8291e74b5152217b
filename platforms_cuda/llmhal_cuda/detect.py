"""Finding NVIDIA GPUs without creating a CUDA context.

Detection goes through NVML (``pynvml``, from the ``nvidia-ml-py`` distribution): NVML talks to the
driver, not the CUDA runtime, so probing never allocates device memory, never initialises CUDA in a
process that later forks, and works before ``CUDA_VISIBLE_DEVICES`` is final. When NVML itself is
missing (Jetson/Tegra boards ship no NVML) the presence of Tegra firmware files is taken as "an
integrated NVIDIA GPU is here", and the platform asks ``torch.cuda`` for details later, on first use.

Seams for tests: ``sys.modules["pynvml"]`` (a fake NVML module) and :data:`JETSON_MARKERS`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from llmhal.platforms import DeviceCapability, PlatformUnavailable

# Files that exist on NVIDIA Jetson/Tegra systems (L4T), whose integrated GPU has no NVML.
JETSON_MARKERS: tuple[str, ...] = ("/etc/nv_tegra_release", "/sys/class/tegra-firmware")

NVML = "nvml"
JETSON = "jetson"


@dataclass(frozen=True)
class CudaDevice:
    """One physical GPU as NVML reports it. ``index`` is NVML's (physical) index."""

    index: int
    name: str
    uuid: str
    capability: DeviceCapability
    total_memory: int
    pci_bus_id: str = ""  # "00000000:3B:00.0": CUDA's order under CUDA_DEVICE_ORDER=PCI_BUS_ID
    mig_uuids: tuple[str, ...] = ()  # "MIG-..." of the MIG instances, when MIG is enabled


@dataclass(frozen=True)
class CudaInventory:
    """What detection found. ``devices`` is empty for the Jetson fallback (details come from torch)."""

    source: str  # NVML or JETSON
    devices: tuple[CudaDevice, ...] = ()
    driver_version: str = ""
    jetson_marker: str = ""


def _text(value: Any) -> str:
    # pynvml returned bytes before 11.5 and str after; accept both.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def import_pynvml() -> ModuleType:
    """Import NVML's Python binding (raises ImportError when ``nvidia-ml-py`` is missing)."""
    return importlib.import_module("pynvml")


def _is_library_missing(nvml: ModuleType, exc: BaseException) -> bool:
    """True when ``exc`` says libnvidia-ml.so itself cannot be loaded (not that the driver failed)."""
    missing = getattr(nvml, "NVMLError_LibraryNotFound", None)
    if missing is not None and isinstance(exc, missing):
        return True
    code = getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", 12)
    return getattr(exc, "value", None) == code


@contextlib.contextmanager
def nvml_session() -> Iterator[ModuleType]:
    """``nvmlInit`` ... ``nvmlShutdown`` around a block (NVML counts nested inits)."""
    nvml = import_pynvml()
    nvml.nvmlInit()
    try:
        yield nvml
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _pci_bus_id(nvml: ModuleType, handle: Any) -> str:
    try:
        return _text(nvml.nvmlDeviceGetPciInfo(handle).busId).upper()
    except Exception:
        return ""


def _mig_uuids(nvml: ModuleType, handle: Any) -> tuple[str, ...]:
    """UUIDs of the MIG instances of a GPU in MIG mode (empty otherwise, or without MIG support)."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
            return ()
        count = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    except Exception:  # no MIG support on this GPU or driver
        return ()
    uuids = []
    for i in range(count):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            uuids.append(_text(nvml.nvmlDeviceGetUUID(mig)))
        except Exception:  # NVML_ERROR_NOT_FOUND: no instance in this slot
            continue
    return tuple(uuids)


def _read_device(nvml: ModuleType, index: int) -> CudaDevice:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    try:
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
    except Exception:  # some virtualised GPUs refuse UUID queries; the UUID is only for matching
        uuid = ""
    return CudaDevice(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        uuid=uuid,
        capability=DeviceCapability(int(major), int(minor)),
        total_memory=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
        pci_bus_id=_pci_bus_id(nvml, handle),
        mig_uuids=_mig_uuids(nvml, handle),
    )


def jetson_marker() -> str | None:
    """The first Tegra marker file that exists, or None."""
    for path in JETSON_MARKERS:
        if os.path.exists(path):
            return path
    return None


def _jetson_or_raise(why: str) -> CudaInventory:
    marker = jetson_marker()
    if marker is not None:
        return CudaInventory(JETSON, jetson_marker=marker)
    raise PlatformUnavailable(why)


def detect_cuda() -> CudaInventory:
    """Find the NVIDIA GPUs of this host, or raise :class:`PlatformUnavailable` saying why not.

    Never touches ``torch.cuda`` (no CUDA context is created). Reasons, in the order checked:
    ``nvidia-ml-py`` not installed; NVML library not found (no driver); NVML failed to initialise
    (the driver's error is quoted); NVML sees no GPU. The first two fall back to the Jetson markers.
    """
    try:
        nvml = import_pynvml()
    except ImportError:
        return _jetson_or_raise(
            "NVML Python binding not installed (pip install nvidia-ml-py) and no Jetson found"
        )
    try:
        nvml.nvmlInit()
    except Exception as e:
        if _is_library_missing(nvml, e):
            return _jetson_or_raise("NVML library not found (no NVIDIA driver installed)")
        raise PlatformUnavailable(
            f"NVML failed to initialise: {type(e).__name__}: {e} (is the NVIDIA driver loaded?)"
        ) from e
    try:
        count = int(nvml.nvmlDeviceGetCount())
        if count == 0:
            raise PlatformUnavailable("NVML found no NVIDIA GPU")
        devices = tuple(_read_device(nvml, i) for i in range(count))
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception:
            driver = ""
    except PlatformUnavailable:
        raise
    except Exception as e:
        raise PlatformUnavailable(f"NVML query failed: {type(e).__name__}: {e}") from e
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
    return CudaInventory(NVML, devices, driver)
