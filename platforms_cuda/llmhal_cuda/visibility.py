"""``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``: which physical GPUs a process sees, in which
order.

CUDA numbers GPUs in ``CUDA_DEVICE_ORDER``: ``PCI_BUS_ID`` is the PCI bus order, the default
``FASTEST_FIRST`` puts the fastest GPU first and leaves the rest unspecified. NVML ignores both
variables and numbers GPUs itself, so a GPU's NVML index is its CUDA index only when the orders
agree: always under ``PCI_BUS_ID`` (ordered here by each GPU's PCI bus id), and on hosts whose GPUs
are all alike. On a mixed host with ``FASTEST_FIRST`` the platform sets ``CUDA_DEVICE_ORDER=
PCI_BUS_ID`` before CUDA starts (:func:`pin_device_order`), or, when CUDA already runs, reads the
order from CUDA itself (by UUID), so that device ``i``'s capability and memory are device ``i``'s.

``CUDA_VISIBLE_DEVICES`` is then read as a comma-separated list of indices into that order, GPU
UUIDs (``GPU-...``, a unique prefix is enough) or MIG instances (``MIG-<uuid>``, or the older
``MIG-GPU-<gpu uuid>/<gi>/<ci>``), which stand for their parent GPU here. Parsing stops at the first
entry that is invalid, unknown or a repeat, so ``"0,7,1"`` on a 4-GPU host exposes only GPU 0. Set
but empty hides every GPU.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from llmhal.logger import init_logger
from llmhal.platforms.accelerator import visible_prefix
from llmhal_cuda.detect import CudaDevice

logger = init_logger(__name__)

ENV_VAR = "CUDA_VISIBLE_DEVICES"
ORDER_VAR = "CUDA_DEVICE_ORDER"
PCI_BUS_ID = "PCI_BUS_ID"


def _match_uuid(token: str, devices: Sequence[CudaDevice]) -> int | None:
    hits = [d.index for d in devices if d.uuid and d.uuid.startswith(token)]
    return hits[0] if len(hits) == 1 else None


def _mig_parent(token: str, devices: Sequence[CudaDevice]) -> int | None:
    if token.startswith("MIG-GPU-"):  # drivers before R470: MIG-GPU-<gpu uuid>/<gi>/<ci>
        return _match_uuid(token[4:].split("/", 1)[0], devices)
    hits = [d.index for d in devices if any(m.startswith(token) for m in d.mig_uuids)]
    return hits[0] if len(hits) == 1 else None


def homogeneous(devices: Sequence[CudaDevice]) -> bool:
    """True when every GPU is the same model (any enumeration order gives the same facts)."""
    return len({(d.name, d.capability, d.total_memory) for d in devices}) <= 1


def cuda_order(
    devices: Sequence[CudaDevice], cuda_uuids: Sequence[str] | None = None
) -> list[CudaDevice]:
    """The devices in CUDA's numbering. ``cuda_uuids``: the UUIDs CUDA itself reports, index by
    index, when it is already running (they decide); otherwise PCI bus order, which is CUDA's under
    ``PCI_BUS_ID`` and, for alike GPUs, under ``FASTEST_FIRST`` too."""
    if cuda_uuids:
        by_uuid = {d.uuid.lower(): d for d in devices if d.uuid}
        ordered = [by_uuid.get(u.lower()) for u in cuda_uuids]
        if all(d is not None for d in ordered) and len(ordered) == len(devices):
            return ordered  # type: ignore[return-value]
    return sorted(devices, key=lambda d: (d.pci_bus_id or "", d.index))


def visible_indices(
    value: str | None,
    devices: Sequence[CudaDevice],
    cuda_uuids: Sequence[str] | None = None,
) -> list[int]:
    """Physical (NVML) indices of the GPUs visible under ``CUDA_VISIBLE_DEVICES=value``, in CUDA's
    numbering (:func:`cuda_order`). ``value`` None means the variable is unset: every GPU."""
    ordered = cuda_order(devices, cuda_uuids)

    def pick(token: str) -> int | None:
        if token.isdigit():
            return ordered[int(token)].index if int(token) < len(ordered) else None
        if token.startswith("GPU-"):
            return _match_uuid(token, devices)
        if token.startswith("MIG-"):
            return _mig_parent(token, devices)
        return None  # "", "-1", garbage: CUDA stops here

    return visible_prefix(value, [d.index for d in ordered], pick)


def _cuda_uuids_if_running() -> list[str] | None:
    """CUDA's own device UUIDs, index by index, when torch already started CUDA; else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return [
        "GPU-" + str(torch.cuda.get_device_properties(i).uuid)
        for i in range(torch.cuda.device_count())
    ]


def pin_device_order(
    devices: Sequence[CudaDevice], env: Mapping[str, str] | None = None
) -> list[str] | None:
    """Make CUDA's numbering knowable from NVML before anything asks for it.

    Mixed GPUs under ``FASTEST_FIRST`` (the default): set ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` while
    CUDA has not started (it reads the variable once, at initialisation; child processes inherit
    it), logging that it did; if CUDA already runs, return its UUIDs in its order instead.
    """
    env = os.environ if env is None else env
    if env.get(ORDER_VAR, "FASTEST_FIRST") == PCI_BUS_ID or homogeneous(devices):
        return None
    running = _cuda_uuids_if_running()
    if running is not None:
        return running
    os.environ[ORDER_VAR] = PCI_BUS_ID
    logger.info(
        "This host mixes GPU models and %s is %r: set %s=%s so that CUDA numbers GPUs as NVML "
        "reports them (set it yourself to silence this)",
        ORDER_VAR,
        env.get(ORDER_VAR, "FASTEST_FIRST (unset)"),
        ORDER_VAR,
        PCI_BUS_ID,
    )
    return None
