"""``AcceleratorPlatform``: the behaviour accelerator vendors inherit (device records, visibility
lists, the KV-cache budget, device control through torch's device module)."""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch

from llmhal.platforms import AcceleratorPlatform, DeviceCapability
from llmhal.platforms.accelerator import visible_prefix

GiB = 1 << 30


@dataclass(frozen=True)
class _Dev:
    index: int
    name: str
    uuid: str
    capability: DeviceCapability
    total_memory: int


DEVICES = (
    _Dev(0, "npu-a", "NPU-aaaa", DeviceCapability(2, 0), 16 * GiB),
    _Dev(1, "npu-b", "NPU-bbbb", DeviceCapability(3, 1), 32 * GiB),
)


class _Npu(AcceleratorPlatform):
    name = "npu"
    device_type = "npu"
    device_label = "NPU"
    device_control_env_var = "NPU_VISIBLE_DEVICES"

    def visible_devices(self) -> list[_Dev]:
        import os

        return visible_prefix(
            os.environ.get("NPU_VISIBLE_DEVICES"),
            list(DEVICES),
            lambda t: DEVICES[int(t)] if t.isdigit() and int(t) < len(DEVICES) else None,
        )

    def mem_get_info(self, device_id: int = 0) -> tuple[int, int]:
        total = self.get_device_total_memory(device_id)
        return total // 2, total


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, [0, 1, 2]), ("2, 0", [2, 0]), ("0,7,1", [0]), ("1,1", [1]), ("", []), ("x,0", [])],
)
def test_visible_prefix_reads_lists_like_device_runtimes(value, expected):
    pick = lambda t: int(t) if t.isdigit() and int(t) < 3 else None  # noqa: E731
    assert visible_prefix(value, [0, 1, 2], pick) == expected


def test_device_facts_come_from_the_visible_records(monkeypatch):
    monkeypatch.setenv("NPU_VISIBLE_DEVICES", "1")
    p = _Npu()
    assert p.device_count() == 1 and p.physical_device_id(0) == 1
    assert (p.get_device_name(), p.get_device_uuid(), p.device_capability()) == (
        "npu-b",
        "NPU-bbbb",
        DeviceCapability(3, 1),
    )
    assert p.get_device_total_memory(0) == 32 * GiB
    with pytest.raises(IndexError, match=r"NPU device 1 does not exist: 1 visible "):
        p.get_device_name(1)
    with pytest.raises(IndexError, match=r"\(NPU_VISIBLE_DEVICES='1'\)"):
        p.physical_device_id(3)


def test_kv_cache_budget_is_a_share_of_free_memory(monkeypatch):
    monkeypatch.delenv("NPU_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("LLMHAL_GPU_MEMORY_UTILIZATION", raising=False)
    p = _Npu()
    assert p.kv_cache_memory_budget(GiB) == int(8 * GiB * 0.9)  # weights already excluded
    monkeypatch.setenv("LLMHAL_GPU_MEMORY_UTILIZATION", "0.25")
    assert p.kv_cache_memory_budget(0, device_id=1) == 4 * GiB
    for bad in ("0", "1.5", "lots"):
        monkeypatch.setenv("LLMHAL_GPU_MEMORY_UTILIZATION", bad)
        with pytest.raises(ValueError, match=r"LLMHAL_GPU_MEMORY_UTILIZATION=.*\(0, 1\]"):
            p.kv_cache_memory_budget(0)


def test_device_control_goes_through_the_torch_device_module(monkeypatch):
    calls = []
    module = types.SimpleNamespace(
        set_device=lambda d: calls.append(("set", d)),
        synchronize=lambda i: calls.append(("sync", i)),
        manual_seed_all=lambda s: calls.append(("seed", s)),
    )
    asked = []
    monkeypatch.setattr(torch, "get_device_module", lambda t: asked.append(t) or module)
    p = _Npu()
    p.set_device("npu:1")
    p.synchronize(1)
    p.seed(5)
    assert calls == [("set", "npu:1"), ("sync", 1), ("seed", 5)]
    assert set(asked) == {"npu"}
    assert torch.initial_seed() == 5  # the base seeding ran too


def test_inventory_is_detected_once_unless_injected():
    class _Counted(_Npu):
        calls = 0

        def detect(self) -> str:
            type(self).calls += 1
            return "found"

    p = _Counted()
    assert (p.inventory, p.inventory, _Counted.calls) == ("found", "found", 1)
    assert _Counted("given").inventory == "given" and _Counted.calls == 1
    with pytest.raises(NotImplementedError, match="'npu' does not detect its devices"):
        _ = _Npu().inventory
