"""Collectives go through the platform's device communicator: core's default over torch.distributed,
or a vendor's own class (a fake vendor platform whose communicator records every call). Also the
trivial world of one process (no torch.distributed at all) and the collective counters."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llmhal.distributed.launch import run_ranks
from llmhal.testing.distributions import build_distributions
from llmhal.testing.fake_vendor import accelerator_distribution

_COMM_MODULE = """
from llmhal.distributed.communicator import DeviceCommunicatorBase

CALLS = []


class RecordingCommunicator(DeviceCommunicatorBase):
    # A vendor's communicator: records each call, then runs the base collective.
    def all_reduce(self, t):
        CALLS.append(("all_reduce", self.unique_name.split(":")[0], tuple(t.shape)))
        return super().all_reduce(t)

    def all_gather(self, t, dim=-1):
        CALLS.append(("all_gather", self.unique_name.split(":")[0], tuple(t.shape)))
        return super().all_gather(t, dim)

    def send(self, t, dst):
        CALLS.append(("send", self.unique_name.split(":")[0], tuple(t.shape)))
        super().send(t, dst)
"""


def _collectives(rank: int) -> dict[str, Any]:
    """Every collective on 2 ranks (TP group = world), with the counters on."""
    from llmhal.distributed import get_pp_group, get_tp_group, get_world_group
    from llmhal.distributed.stats import record_collectives
    from llmhal.platforms import current_platform

    tp = get_tp_group()
    mine = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
    out: dict[str, Any] = {
        "platform": current_platform.name,
        "communicator": type(tp.communicator).__name__,
        "ranks": (tp.rank_in_group, tp.world_size, tp.is_first_rank, tp.is_last_rank),
        "pp": get_pp_group().world_size,
    }
    with record_collectives() as stats:
        out["all_reduce"] = tp.all_reduce(mine.clone()).tolist()
        out["all_gather"] = tp.all_gather(mine, dim=-1).tolist()
        out["all_gather0"] = tp.all_gather(mine, dim=0).shape
        g = tp.gather(mine, dst=1, dim=0)
        out["gather"] = None if g is None else g.tolist()
        out["reduce_scatter"] = tp.reduce_scatter(mine.clone(), dim=0).tolist()
        out["broadcast"] = tp.broadcast(mine.clone(), src=1).tolist()
        out["object"] = tp.broadcast_object({"from": rank} if rank == 0 else None, src=0)
        world = get_world_group()
        if rank == 0:
            world.send_tensor_dict({"h": mine, "r": mine.to(torch.bfloat16)})
            out["recv"] = None
        else:
            got = world.recv_tensor_dict()
            out["recv"] = {k: (v.dtype, v.tolist()) for k, v in got.items()}
    out["stats"] = stats.summary()
    try:
        import commnpu.comm as comm

        out["calls"] = list(comm.CALLS)
    except ImportError:
        out["calls"] = None
    return out


@pytest.fixture(scope="module")
def vendor_run(tmp_path_factory) -> list[dict[str, Any]]:
    """The collectives on a fake vendor platform that brings its own communicator."""
    dist = accelerator_distribution(
        "commnpu",
        priority=200,
        platform_body='    device_communicator_cls = "commnpu.comm:RecordingCommunicator"\n',
    )
    dist.modules["commnpu/comm.py"] = _COMM_MODULE  # type: ignore[index]
    root = build_distributions(tmp_path_factory.mktemp("commnpu"), dist)
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(root))  # spawned ranks inherit sys.path and the environment
    mp.setenv("VLLM_PLATFORM", "commnpu")
    try:
        return run_ranks(_collectives, 2, 1, backend=None)  # backend: the platform's
    finally:
        mp.undo()


def test_vendor_communicator_is_used(vendor_run):
    for rank, r in enumerate(vendor_run):
        assert r["platform"] == "commnpu"
        assert r["communicator"] == "RecordingCommunicator"
        assert r["ranks"] == (rank, 2, rank == 0, rank == 1) and r["pp"] == 1
        kinds = [(op, group) for op, group, _ in r["calls"]]
        assert ("all_reduce", "tp") in kinds and ("all_gather", "tp") in kinds
    assert ("send", "world", (2, 3)) in vendor_run[0]["calls"]


def test_collective_results(vendor_run):
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = a + 10
    for rank, r in enumerate(vendor_run):
        assert r["all_reduce"] == (a + b).tolist()
        assert r["all_gather"] == torch.cat([a, b], dim=-1).tolist()
        assert tuple(r["all_gather0"]) == (4, 3)
        assert r["reduce_scatter"] == (a + b)[rank : rank + 1].tolist()
        assert r["broadcast"] == b.tolist()
        assert r["object"] == {"from": 0}
    assert vendor_run[0]["gather"] is None
    assert vendor_run[1]["gather"] == torch.cat([a, b]).tolist()
    recv = vendor_run[1]["recv"]
    assert recv["h"] == (torch.float32, a.tolist())
    assert recv["r"] == (torch.bfloat16, a.tolist())


def test_collective_counters(vendor_run):
    stats = vendor_run[0]["stats"]
    ar = stats["all_reduce/tp"]
    assert ar["calls"] == 1 and ar["bytes"] == 6 * 4 and ar["seconds"] > 0
    assert stats["all_gather/tp"]["calls"] == 2
    assert stats["send/world"]["calls"] == 2 and stats["send/world"]["bytes"] == 6 * 4 + 6 * 2
    assert "recv/world" in vendor_run[1]["stats"]


def _stuck(rank: int) -> None:
    """Rank 0 waits in an all-reduce that rank 1 never joins."""
    import time

    from llmhal.distributed import get_tp_group

    if rank == 0:
        get_tp_group().all_reduce(torch.ones(2))
    time.sleep(60)


def test_a_hung_collective_times_out_and_leaves_no_process():
    import multiprocessing

    before = set(multiprocessing.active_children())
    with pytest.raises(TimeoutError, match="_stuck on 2 ranks"):
        run_ranks(_stuck, 2, 1, timeout=8)
    assert set(multiprocessing.active_children()) <= before


def test_the_default_communicator_is_cores():
    from llmhal.platforms import Platform

    class Plain(Platform):
        pass

    class Vendor(Platform):
        device_communicator_cls = "vendor.comm:Comm"

    assert Plain.get_device_communicator_cls() == (
        "llmhal.distributed.communicator:DeviceCommunicatorBase"
    )
    assert Vendor.get_device_communicator_cls() == "vendor.comm:Comm"


def test_not_initialized_is_a_free_world_of_one():
    import sys

    from llmhal.distributed import distributed_initialized, get_pp_group, get_tp_group

    assert not distributed_initialized()
    tp, pp = get_tp_group(), get_pp_group()
    assert (tp.world_size, tp.rank_in_group, tp.is_first_rank, tp.is_last_rank) == (
        1,
        0,
        True,
        True,
    )
    t = torch.ones(3)
    assert tp.all_reduce(t) is t and tp.all_gather(t) is t and tp.broadcast(t) is t
    assert tp.gather(t) is t and tp.broadcast_object("x") == "x"
    with pytest.raises(RuntimeError, match="pipeline_parallel_size > 1"):
        pp.send(t)
    # Single-process code never starts torch.distributed.
    dist = sys.modules.get("torch.distributed")
    assert dist is None or not dist.is_initialized()


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"world_size": 3, "rank": 0, "tensor_parallel_size": 2}, "must equal"),
        ({"world_size": 2, "rank": 2, "tensor_parallel_size": 2}, "outside the world"),
        ({"world_size": 0, "rank": 0, "tensor_parallel_size": 0}, ">= 1"),
    ],
)
def test_init_distributed_rejects_bad_sizes(kw, words):
    from llmhal.distributed import init_distributed

    with pytest.raises(ValueError, match=words):
        init_distributed(distributed_init_method="tcp://127.0.0.1:1", **kw)
