"""CpuPlatform: the shared conformance suite, plus what is specific to the CPU."""

from __future__ import annotations

import os

import pytest
import torch

from llmhal.testing.platform_conformance import PlatformConformanceSuite
from llmhal_cpu import cpu_platform_plugin, cpuinfo
from llmhal_cpu.platform import CpuPlatform, GiB


class TestCpuPlatformConformance(PlatformConformanceSuite):
    platform_cls = CpuPlatform
    probe = staticmethod(cpu_platform_plugin)


def test_is_the_always_available_fallback():
    assert CpuPlatform.is_fallback and CpuPlatform.priority == 0
    assert cpu_platform_plugin.llmhal_platform_class == "llmhal_cpu.platform:CpuPlatform"


@pytest.mark.parametrize(
    ("flags", "fast_bf16"),
    [
        ({"avx2", "fma"}, False),  # an AVX2+FMA-only machine
        ({"avx2", "fma", "avx512f", "avx512_bf16"}, True),
        ({"asimd", "bf16"}, True),  # Arm with the bf16 extension
    ],
)
def test_capabilities_follow_the_isa(monkeypatch, flags, fast_bf16):
    monkeypatch.setattr(cpuinfo, "cpu_flags", lambda: frozenset(flags))
    caps = CpuPlatform().capabilities
    assert caps.fast_bf16_matmul is fast_bf16
    assert set(caps.extra["isa"]) <= flags
    assert caps.bf16 and caps.fp16 and not caps.fp8_compute and caps.unified_memory


def test_memory_matches_the_host():
    platform = CpuPlatform()
    page_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert abs(platform.get_device_total_memory() - page_total) <= page_total // 20
    free, total = platform.mem_get_info()
    assert 0 < free <= total == platform.get_device_total_memory()


def test_kv_cache_budget(monkeypatch):
    platform = CpuPlatform()
    monkeypatch.setenv("LLMHAL_CPU_KVCACHE_SPACE", "0.5")
    assert platform.kv_cache_memory_budget(0) == GiB // 2
    monkeypatch.setenv("LLMHAL_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="LLMHAL_CPU_KVCACHE_SPACE='lots'"):
        platform.kv_cache_memory_budget(0)
    monkeypatch.delenv("LLMHAL_CPU_KVCACHE_SPACE")
    budget = platform.kv_cache_memory_budget(0)
    assert 0 < budget <= min(4 * GiB, cpuinfo.available_memory())


def test_num_threads_variable_is_applied(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("LLMHAL_NUM_THREADS", "1")
    try:
        CpuPlatform().check_and_update_config(None)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_host_facts():
    assert cpuinfo.usable_cores() >= 1
    assert cpuinfo.cpu_model_name()
    if os.path.exists("/proc/cpuinfo"):
        assert cpuinfo.cpu_flags()
