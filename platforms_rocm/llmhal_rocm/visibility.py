"""Which physical AMD GPUs a process sees: ``ROCR_VISIBLE_DEVICES`` then ``HIP_VISIBLE_DEVICES``.

Two filters stack. The ROCr runtime applies ``ROCR_VISIBLE_DEVICES`` first (indices, or ``GPU-``
followed by the ASIC's 16-hex-digit unique id, as ``rocminfo`` prints it; amdsmi's dashed UUID is a
different string, derived from that id); HIP then applies ``HIP_VISIBLE_DEVICES`` (or ``CUDA_VISIBLE_DEVICES``, which
HIP honours the same way) as indices into what ROCr left. Each list stops at its first invalid or
repeated entry, and a list that is set but empty hides everything. amdsmi ignores both and numbers
physical GPUs, which is what the platform's device records are keyed by.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from llmhal.platforms.accelerator import visible_prefix
from llmhal_rocm.detect import RocmDevice, normalize_serial

ENV_VAR = "HIP_VISIBLE_DEVICES"
ROCR_VAR = "ROCR_VISIBLE_DEVICES"
CUDA_VAR = "CUDA_VISIBLE_DEVICES"


def _filter(value: str | None, candidates: list[RocmDevice], allow_uuid: bool) -> list[RocmDevice]:
    def pick(token: str) -> RocmDevice | None:
        if token.isdigit() and int(token) < len(candidates):
            return candidates[int(token)]
        if allow_uuid and token.upper().startswith("GPU-"):
            serial = normalize_serial(token[4:])
            hits = [d for d in candidates if serial and d.serial == serial]
            return hits[0] if len(hits) == 1 else None
        return None

    return visible_prefix(value, candidates, pick)


def hip_visible_value(env: Mapping[str, str] | None = None) -> str | None:
    """The HIP-level list in effect; ValueError when HIP_ and CUDA_VISIBLE_DEVICES disagree."""
    env = os.environ if env is None else env
    hip, cuda = env.get(ENV_VAR), env.get(CUDA_VAR)
    if hip is not None and cuda is not None and hip != cuda:
        raise ValueError(
            f"{ENV_VAR}={hip!r} and {CUDA_VAR}={cuda!r} disagree; HIP honours both, so set only "
            f"one of them (or the same value in both)"
        )
    return hip if hip is not None else cuda


def visible_devices(
    devices: Sequence[RocmDevice], env: Mapping[str, str] | None = None
) -> list[RocmDevice]:
    """The devices HIP will number 0, 1, ... in this process."""
    env = os.environ if env is None else env
    after_rocr = _filter(env.get(ROCR_VAR), list(devices), allow_uuid=True)
    return _filter(hip_visible_value(env), after_rocr, allow_uuid=False)
