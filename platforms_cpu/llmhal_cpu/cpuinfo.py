"""Host facts without psutil or torch: memory from /proc/meminfo, ISA flags from /proc/cpuinfo."""

from __future__ import annotations

import functools
import os


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    return out


def total_memory() -> int:
    info = _meminfo()
    if "MemTotal" in info:
        return info["MemTotal"]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory() -> int:
    info = _meminfo()
    if "MemAvailable" in info:
        return info["MemAvailable"]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """ISA feature flags of the first CPU (x86 'flags' or Arm 'Features'); empty if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(rest.split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model"):
                    return rest.strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "CPU"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
