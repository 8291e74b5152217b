"""The OpenMP wait policy llmhal runs under, chosen before torch loads its OpenMP runtime.

When a parallel region ends, libgomp's idle threads by default spin for 300,000 pause instructions
(milliseconds) before they sleep. A decode step runs ~150 small parallel regions, so the moment
anything else wants the cores (a second llmhal process, a busy browser) the spinning threads take
the time slices the working threads need, and every region waits out a scheduler tick. Sleeping
threads (``OMP_WAIT_POLICY=PASSIVE``) instead pay a futex wake-up (tens of microseconds in a VM)
at every region. A short spin keeps threads awake across the gaps between a step's regions and
parks them when the process stops. Measured on a 2-core VM, SmolLM2-135M Q4_1, decode tok/s
(batch-1 GEMVs kept on one thread except with the runtime default):

    policy                    b1 quiet   b1 one core busy   b1 two processes (each)   b32 quiet
    runtime default (spin)         134                 45                         1        1003
    PASSIVE                        111                109                       109         708
    GOMP_SPINCOUNT=2000            102                101                        99        1113

So llmhal sets ``GOMP_SPINCOUNT=2000`` unless the user chose a policy; on a dedicated machine
``OMP_WAIT_POLICY=ACTIVE`` buys batch-1 decode back. Kernels read :func:`threads_park_quickly` to
size their parallel regions.
"""

from __future__ import annotations

import os
import re
import sys

DEFAULT_SPINCOUNT = "2000"
# Variables through which a user chooses the wait policy (libgomp's and Intel OpenMP's).
_USER_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
# Spin counts up to this park threads within a fraction of a millisecond.
_SHORT_SPIN = 100_000
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def apply_default_wait_policy() -> bool:
    """Set ``GOMP_SPINCOUNT`` to a short spin if nothing chose a policy and torch is not loaded.

    OpenMP runtimes read these variables once, when they load (with torch), so this runs from
    ``import llmhal``; once torch is imported it would be a lie and nothing is set. Returns whether
    it set the variable.
    """
    if "torch" in sys.modules or any(name in os.environ for name in _USER_CHOICES):
        return False
    os.environ["GOMP_SPINCOUNT"] = DEFAULT_SPINCOUNT
    return True


def openmp_wait_policy() -> str:
    """``"passive"``, ``"active"``, ``"short-spin"`` (GOMP_SPINCOUNT <= 100k) or ``"spin"``."""
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().lower()
    if policy in ("passive", "active"):
        return policy
    match = re.fullmatch(r"(\d+)\s*([kmgt]?)", os.environ.get("GOMP_SPINCOUNT", "").strip().lower())
    if match and int(match[1]) * _SUFFIX[match[2]] <= _SHORT_SPIN:
        return "short-spin"
    return "spin"


def threads_park_quickly() -> bool:
    """Whether idle OpenMP threads stop spinning soon: each parallel region then costs a wake-up,
    and a kernel is better off running small work on one thread."""
    return openmp_wait_policy() in ("passive", "short-spin")
