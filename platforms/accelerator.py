"""``AcceleratorPlatform``: base behaviour for discrete accelerators that a vendor library enumerates.

Many accelerator platforms look alike from the engine's side: a detection library (NVML, amdsmi,
...) lists the physical devices, an environment variable in the style of ``*_VISIBLE_DEVICES``
selects and orders the ones this process sees, and torch drives them through its device module for
the platform's ``device_type`` (``torch.get_device_module(device_type)``: ``set_device``,
``synchronize``, ``manual_seed_all``). A vendor subclasses :class:`AcceleratorPlatform`, implements
:meth:`AcceleratorPlatform.detect` (its inventory: what the library found),
:meth:`AcceleratorPlatform.visible_devices` (records with the fields of :class:`DeviceRecord`) and
``mem_get_info``, and inherits the rest. Nothing here names a vendor or imports torch at import time.

The KV-cache budget of an accelerator is a share of the device's free memory once the weights are
resident: ``LLMHAL_GPU_MEMORY_UTILIZATION`` (a fraction in (0, 1], default 0.9).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from llmhal.platforms.interface import DeviceCapability, Platform

if TYPE_CHECKING:  # pragma: no cover
    import torch

MEMORY_FRACTION_ENV = "LLMHAL_GPU_MEMORY_UTILIZATION"
DEFAULT_MEMORY_FRACTION = 0.9

T = TypeVar("T")
InventoryT = TypeVar("InventoryT")


def memory_fraction() -> float:
    """``LLMHAL_GPU_MEMORY_UTILIZATION`` as a fraction in (0, 1]; 0.9 when unset.

    Raises ValueError naming the variable when it is not a number in that range.
    """
    raw = os.environ.get(MEMORY_FRACTION_ENV)
    if not raw:
        return DEFAULT_MEMORY_FRACTION
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise ValueError(
            f"{MEMORY_FRACTION_ENV}={raw!r} must be a fraction in (0, 1], e.g. 0.9 (the share of "
            f"free GPU memory the KV cache may use)"
        )
    return value


def visible_prefix(
    value: str | None, candidates: Sequence[T], pick: Callable[[str], T | None]
) -> list[T]:
    """The entries a ``*_VISIBLE_DEVICES``-style list selects, the way device runtimes read it.

    ``value`` None (the variable is unset) selects every candidate in order. Otherwise the
    comma-separated entries (whitespace stripped) are mapped through ``pick``; reading stops at the
    first entry that ``pick`` rejects (None) or that repeats an earlier one, so a set but empty
    value selects nothing.
    """
    if value is None:
        return list(candidates)
    out: list[T] = []
    for raw in value.split(","):
        item = pick(raw.strip())
        if item is None or item in out:
            break
        out.append(item)
    return out


class DeviceRecord(Protocol):
    """What :class:`AcceleratorPlatform` reads from a detected device (vendor records add more)."""

    @property
    def index(self) -> int: ...  # the physical index, in the detection library's numbering

    @property
    def name(self) -> str: ...

    @property
    def uuid(self) -> str: ...

    @property
    def capability(self) -> DeviceCapability: ...

    @property
    def total_memory(self) -> int: ...


class AcceleratorPlatform(Platform, Generic[InventoryT]):
    """A platform of enumerated accelerator devices driven through torch's device module.

    Subclasses set ``device_type`` (the torch device type), ``device_label`` (how an error names one
    device, e.g. "CUDA device 3") and implement :meth:`detect`, :meth:`visible_devices` and
    ``mem_get_info``. Device facts come from the records, so querying them never initialises the
    device runtime. ``inventory`` may be injected (tests, tools); otherwise :meth:`detect` runs on
    first use.
    """

    device_label: ClassVar[str] = "accelerator"

    def __init__(self, inventory: InventoryT | None = None) -> None:
        self._inventory = inventory

    # ------------------------------------------------------------------------------ devices
    def detect(self) -> InventoryT:
        """Ask the detection library what is there (called once, on first use of ``inventory``)."""
        raise NotImplementedError(f"platform {self.name!r} does not detect its devices")

    @property
    def inventory(self) -> InventoryT:
        """What detection found, cached for the platform's lifetime."""
        if self._inventory is None:
            self._inventory = self.detect()
        return self._inventory

    def visible_devices(self) -> Sequence[DeviceRecord]:
        """The devices this process sees, in logical order (position ``i`` is device id ``i``)."""
        return []

    def visibility_note(self) -> str:
        """The visibility setting in effect, quoted in errors (``VAR='value'``)."""
        var = self.device_control_env_var
        return f"{var}={os.environ.get(var)!r}" if var else "no visibility variable"

    def device_record(self, device_id: int) -> Any:
        """The record of logical device ``device_id``; IndexError saying how many are visible."""
        devices = self.visible_devices()
        if not 0 <= device_id < len(devices):
            raise IndexError(
                f"{self.device_label} device {device_id} does not exist: {len(devices)} visible "
                f"({self.visibility_note()})"
            )
        return devices[device_id]

    def device_count(self) -> int:
        return len(self.visible_devices())

    def physical_device_id(self, device_id: int) -> int:
        return self.device_record(device_id).index

    def device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        return self.device_record(device_id).capability

    def get_device_name(self, device_id: int = 0) -> str:
        return self.device_record(device_id).name

    def get_device_uuid(self, device_id: int = 0) -> str:
        return self.device_record(device_id).uuid

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return self.device_record(device_id).total_memory

    def kv_cache_memory_budget(self, model_bytes: int, device_id: int = 0) -> int:
        """``LLMHAL_GPU_MEMORY_UTILIZATION`` (default 0.9) of the device's free memory.

        The engine asks once the weights are resident, so free memory already excludes them (and
        whatever other processes hold); ``model_bytes`` is not subtracted again.
        """
        free, _total = self.mem_get_info(device_id)
        return int(free * memory_fraction())

    # ------------------------------------------------------------------------ device control
    def torch_device_module(self) -> Any:
        """torch's module for this platform's ``device_type`` (imports torch)."""
        import torch

        return torch.get_device_module(self.device_type)

    def set_device(self, device: torch.device) -> None:
        self.torch_device_module().set_device(device)

    def synchronize(self, device_id: int = 0) -> None:
        self.torch_device_module().synchronize(device_id)

    def seed(self, seed: int) -> None:
        super().seed(seed)
        self.torch_device_module().manual_seed_all(seed)
