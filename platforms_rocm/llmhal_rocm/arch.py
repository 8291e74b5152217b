"""AMD GPU architectures (``gfx...`` names): capability numbers and what each generation can do.

A GCN arch name is ``gfx`` + major (1-2 decimal digits) + minor (1 hex digit) + stepping (1 hex
digit), optionally followed by target features (``gfx942:sramecc+:xnack-``). The platform reports
``major.minor`` as its :class:`DeviceCapability` (gfx90a -> 9.0, gfx942 -> 9.4, gfx950 -> 9.5,
gfx1100 -> 11.0, gfx1201 -> 12.0), the same numbers HIP's device properties give.
"""

from __future__ import annotations

import re

from llmhal.platforms import DeviceCapability

_ARCH_RE = re.compile(r"^gfx(\d{1,2})([0-9a-f])([0-9a-f])$")

# CDNA3 (MI300) stores fp8 as the "fnuz" variants (no negative zero, no inf, bias 8 for e4m3).
FNUZ_ARCHS = frozenset({"gfx940", "gfx941", "gfx942"})
# Hardware fp8 matrix instructions: CDNA3 (fnuz), CDNA4 and RDNA4 (OCP e4m3fn/e5m2).
FP8_COMPUTE_ARCHS = frozenset({"gfx940", "gfx941", "gfx942", "gfx950", "gfx1200", "gfx1201"})
# Matrix cores with bf16 inputs: CDNA1-4 and RDNA3/4 (WMMA).
_FAST_BF16_CDNA = frozenset({"gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx950"})
# Triton's AMD backend targets CDNA2+ and RDNA3+; gfx908 works too.
_TRITON_CDNA = frozenset({"gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx950"})
# AMD's aiter kernels (flash attention) are built for MI300 and MI350.
AITER_ARCHS = frozenset({"gfx942", "gfx950"})


def normalize_arch(name: str) -> str:
    """``"gfx942:sramecc+:xnack-"`` -> ``"gfx942"`` (lower-case, target features dropped)."""
    return name.strip().lower().split(":", 1)[0]


def arch_capability(name: str) -> DeviceCapability:
    """The ``major.minor`` of a GCN arch name; ValueError for a name that is not one."""
    arch = normalize_arch(name)
    m = _ARCH_RE.match(arch)
    if m is None:
        raise ValueError(f"{name!r} is not an AMD GPU architecture name (expected e.g. 'gfx942')")
    return DeviceCapability(int(m.group(1)), int(m.group(2), 16))


def is_fp8_fnuz(arch: str) -> bool:
    return normalize_arch(arch) in FNUZ_ARCHS


def has_fp8_compute(arch: str) -> bool:
    return normalize_arch(arch) in FP8_COMPUTE_ARCHS


def has_fast_bf16(arch: str) -> bool:
    a = normalize_arch(arch)
    return a in _FAST_BF16_CDNA or arch_capability(a).major >= 11


def supports_triton(arch: str) -> bool:
    a = normalize_arch(arch)
    return a in _TRITON_CDNA or arch_capability(a).major >= 11


def supports_aiter(arch: str) -> bool:
    return normalize_arch(arch) in AITER_ARCHS
