"""NVML's numbering against CUDA's: ``CUDA_DEVICE_ORDER`` on hosts that mix GPU models, and MIG
instances in ``CUDA_VISIBLE_DEVICES``.

NVML numbers GPUs its own way; CUDA numbers them fastest first unless ``CUDA_DEVICE_ORDER=
PCI_BUS_ID``. On a mixed host the platform used to take NVML index ``i`` for CUDA device ``i`` and
report another GPU's capability and memory; a MIG identifier hid every GPU.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from llmhal.platforms import DeviceCapability
from llmhal.platforms.resolver import resolve
from llmhal_cuda.platform import CudaPlatform
from llmhal_cuda.visibility import ORDER_VAR, visible_indices


@pytest.fixture
def mixed(gpus, install_nvml, monkeypatch):
    """NVML lists an A100 first, but the H100 sits on the lower PCI bus."""
    # CUDA's default, set through monkeypatch so that the platform's change is undone after.
    monkeypatch.setenv(ORDER_VAR, "FASTEST_FIRST")
    a100 = replace(gpus.A100, pci="00000000:C1:00.0")
    h100 = replace(gpus.H100, pci="00000000:3B:00.0")
    install_nvml([a100, h100])
    return a100, h100


def test_a_mixed_host_gets_pci_bus_order_before_cuda_starts(mixed, monkeypatch):
    a100, h100 = mixed
    platform = CudaPlatform()
    assert platform.device_count() == 2
    assert os.environ[ORDER_VAR] == "PCI_BUS_ID"  # CUDA will number them by PCI bus
    assert platform.get_device_name(0) == h100.name
    assert platform.device_capability(0) == DeviceCapability(9, 0)
    assert platform.physical_device_id(0) == 1  # NVML's index of the H100
    assert platform.get_device_total_memory(1) == a100.total


def test_cuda_visible_devices_counts_in_cuda_order(mixed, monkeypatch):
    _, h100 = mixed
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    platform = CudaPlatform()
    assert [d.name for d in platform.visible_devices()] == [h100.name]


def test_an_order_already_chosen_is_left_alone(gpus, install_nvml, monkeypatch):
    monkeypatch.setenv(ORDER_VAR, "PCI_BUS_ID")
    install_nvml([replace(gpus.A100, pci="00000000:C1:00.0"), replace(gpus.H100, pci="00000000:3B:00.0")])  # fmt: skip
    assert CudaPlatform().get_device_name(0) == gpus.H100.name
    monkeypatch.delenv(ORDER_VAR)
    install_nvml([gpus.H100, gpus.H100])  # alike GPUs: any order gives the same facts
    CudaPlatform().device_count()
    assert ORDER_VAR not in os.environ


def test_cuda_uuids_decide_when_cuda_already_runs(gpus, fake_inventory):
    devices = fake_inventory(gpus.A100, gpus.H100).devices
    cuda = [gpus.H100.uuid, gpus.A100.uuid]
    assert visible_indices(None, devices, cuda) == [1, 0]
    assert visible_indices("1", devices, cuda) == [0]


MIG = ("MIG-5f0ab3c2-1e2d-5a6b-9c8d-7e6f5a4b3c2d", "MIG-6a1bc4d3-2f3e-5b7c-8d9e-8f7a6b5c4d3e")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (MIG[1], [1]),  # a MIG instance of the second GPU
        (MIG[1][:12], [1]),  # a unique prefix, as for GPU UUIDs
        ("MIG-GPU-22222222-bbbb/1/0", [1]),  # drivers before R470 name the parent GPU
        ("MIG-0000dead", []),  # unknown: CUDA stops there
    ],
)
def test_mig_instances_stand_for_their_gpu(gpus, fake_inventory, value, expected):
    devices = fake_inventory(gpus.H100, replace(gpus.A100, mig=MIG)).devices
    assert visible_indices(value, devices) == expected


def test_mig_uuids_come_from_nvml(gpus, install_nvml, monkeypatch):
    install_nvml([gpus.H100, replace(gpus.A100, mig=MIG)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG[0])
    platform, selection = resolve()  # the probe used to say "hides all 2 NVIDIA GPU(s)"
    assert isinstance(platform, CudaPlatform), selection.probes
    assert platform.inventory.devices[1].mig_uuids == MIG
    assert platform.get_device_name(0) == gpus.A100.name
