"""Finding AMD GPUs through amdsmi, without initialising HIP.

amdsmi talks to the amdgpu driver (no HIP context, no device memory). Its Python package is fragile
to import: without ``libamd_smi.so`` it raises KeyError, OSError or ImportError at import time, so
every exception is caught and reported as the reason ROCm is unavailable.

Seam for tests: ``sys.modules["amdsmi"]`` (a fake amdsmi module).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from llmhal.platforms import DeviceCapability, PlatformUnavailable
from llmhal_rocm.arch import arch_capability, normalize_arch

MiB = 1 << 20


@dataclass(frozen=True)
class RocmDevice:
    """One physical GPU as amdsmi reports it; ``index`` is its position in amdsmi's handle list."""

    index: int
    name: str
    uuid: str
    arch: str  # normalised, e.g. "gfx942"
    capability: DeviceCapability
    total_memory: int
    # The ASIC's unique id as 16 lower-case hex digits: what ROCr's ``GPU-<id>`` names (amdsmi's
    # dashed UUID is generated from it and the device id, and never equals ROCr's form).
    serial: str = ""


@dataclass(frozen=True)
class RocmInventory:
    devices: tuple[RocmDevice, ...]
    driver_version: str = ""


def import_amdsmi() -> ModuleType:
    """Import amdsmi. Any exception (KeyError when the library is missing) propagates."""
    return importlib.import_module("amdsmi")


@contextlib.contextmanager
def amdsmi_session() -> Iterator[ModuleType]:
    smi = import_amdsmi()
    smi.amdsmi_init()
    try:
        yield smi
    finally:
        with contextlib.suppress(Exception):
            smi.amdsmi_shut_down()


def vram_bytes(smi: ModuleType, handle: Any) -> tuple[int, int]:
    """(total, used) VRAM in bytes. Newer amdsmi has byte-exact queries; older only MiB figures."""
    mem_type = getattr(getattr(smi, "AmdSmiMemoryType", None), "VRAM", None)
    if mem_type is not None and hasattr(smi, "amdsmi_get_gpu_memory_total"):
        total = int(smi.amdsmi_get_gpu_memory_total(handle, mem_type))
        used = int(smi.amdsmi_get_gpu_memory_usage(handle, mem_type))
        return total, used
    usage = smi.amdsmi_get_gpu_vram_usage(handle)
    return int(usage["vram_total"]) * MiB, int(usage["vram_used"]) * MiB


def normalize_serial(value: Any) -> str:
    """amdsmi's ``asic_serial`` ("0x4B8A7E3A1C6D2F90") as ROCr writes it ("4b8a7e3a1c6d2f90");
    "" when amdsmi has none ("N/A", empty)."""
    text = str(value or "").strip().lower().removeprefix("0x")
    try:
        return f"{int(text, 16):016x}" if text else ""
    except ValueError:
        return ""


def _read_device(smi: ModuleType, index: int, handle: Any) -> RocmDevice:
    asic = smi.amdsmi_get_gpu_asic_info(handle)
    raw_arch = str(asic.get("target_graphics_version", "") or "")
    if not raw_arch.lower().startswith("gfx"):
        raise PlatformUnavailable(
            f"amdsmi reports no GPU architecture for device {index} "
            f"(target_graphics_version={raw_arch!r}); amdsmi from ROCm >= 6.1 is needed"
        )
    arch = normalize_arch(raw_arch)
    try:
        uuid = str(smi.amdsmi_get_gpu_device_uuid(handle))
    except Exception:
        uuid = ""
    total, _used = vram_bytes(smi, handle)
    market = str(asic.get("market_name") or "").strip()  # amdsmi says "N/A" when it has none
    return RocmDevice(
        index=index,
        name=market if market and market != "N/A" else f"AMD GPU ({arch})",
        uuid=uuid,
        arch=arch,
        capability=arch_capability(arch),
        total_memory=total,
        serial=normalize_serial(asic.get("asic_serial")),
    )


def detect_rocm() -> RocmInventory:
    """Find the AMD GPUs of this host, or raise :class:`PlatformUnavailable` saying why not."""
    try:
        smi = import_amdsmi()
    except ImportError:
        raise PlatformUnavailable(
            "amdsmi is not installed (it ships with ROCm: pip install /opt/rocm/share/amd_smi, or "
            "pip install llmhal-rocm[amdsmi])"
        ) from None
    except Exception as e:  # KeyError/OSError: the Python package is there, libamd_smi.so is not
        raise PlatformUnavailable(
            f"amdsmi cannot load its library ({type(e).__name__}: {e}); is ROCm installed?"
        ) from e
    try:
        smi.amdsmi_init()
    except Exception as e:
        raise PlatformUnavailable(
            f"amdsmi failed to initialise: {type(e).__name__}: {e} (is the amdgpu driver loaded?)"
        ) from e
    try:
        handles = list(smi.amdsmi_get_processor_handles())
        if not handles:
            raise PlatformUnavailable("amdsmi found no AMD GPU")
        devices = tuple(_read_device(smi, i, h) for i, h in enumerate(handles))
        try:
            driver = smi.amdsmi_get_gpu_driver_info(handles[0])
            driver_version = (
                str(driver.get("driver_version", "")) if isinstance(driver, dict) else ""
            )
        except Exception:
            driver_version = ""
    except PlatformUnavailable:
        raise
    except Exception as e:
        raise PlatformUnavailable(f"amdsmi query failed: {type(e).__name__}: {e}") from e
    finally:
        with contextlib.suppress(Exception):
            smi.amdsmi_shut_down()
    return RocmInventory(devices, driver_version)
