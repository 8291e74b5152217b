"""``CUDA_VISIBLE_DEVICES``: which physical GPUs a process sees, in which order.

The CUDA runtime reads the variable as a comma-separated list of GPU indices or UUIDs (``GPU-...``,
a unique prefix is enough). Parsing stops at the first entry that is invalid, unknown or a repeat, so
``"0,7,1"`` on a 4-GPU host exposes only GPU 0. Set but empty hides every GPU. NVML ignores the
variable and always counts physical GPUs, so logical device ``i`` of this process is
``visible_indices(...)[i]`` in NVML's numbering.

MIG instances (``MIG-...``) are not mapped: name the parent GPU instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmhal.platforms.accelerator import visible_prefix
from llmhal_cuda.detect import CudaDevice

ENV_VAR = "CUDA_VISIBLE_DEVICES"


def _match_uuid(token: str, devices: Sequence[CudaDevice]) -> int | None:
    hits = [d.index for d in devices if d.uuid and d.uuid.startswith(token)]
    return hits[0] if len(hits) == 1 else None


def visible_indices(value: str | None, devices: Sequence[CudaDevice]) -> list[int]:
    """Physical (NVML) indices of the GPUs visible under ``CUDA_VISIBLE_DEVICES=value``.

    ``value`` None means the variable is unset: every GPU, in NVML order.
    """
    known = [d.index for d in devices]

    def pick(token: str) -> int | None:
        if token.isdigit():
            return int(token) if int(token) in known else None
        if token.startswith("GPU-"):
            return _match_uuid(token, devices)
        return None  # "", "-1", MIG-..., garbage: CUDA stops here

    return visible_prefix(value, known, pick)
