"""Which processes load which plugin group (ARCHITECTURE.md section 2, vLLM's rule), in every
executor: general and platform plugins in every process (the engine's and each rank's),
io-processor and stat-logger plugins in process 0 only. Each throwaway plugin records the process
it was imported in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmhal.testing.distributions import FakeDistribution
from llmhal.testing.fixtures import install_dists  # noqa: F401  (a fixture)

PLACE_ENV = "LLMHAL_TEST_PLACEMENT_DIR"  # LLMHAL_ variables reach Ray actors too


def _recorder(group: str) -> str:
    return textwrap.dedent(
        f"""
        import os
        _d = os.environ.get({PLACE_ENV!r})
        if _d:
            with open(os.path.join(_d, {group!r} + "." + str(os.getpid())), "a") as _f:
                _f.write("x\\n")
        """
    )


PLACEMENT_DIST = FakeDistribution(
    "placement-plugins",
    entry_points={
        "vllm.general_plugins": {"place_general": "place_general:register"},
        "vllm.platform_plugins": {"place_platform": "place_platform:probe"},
        "vllm.stat_logger_plugins": {"place_stats": "place_stats:Recorder"},
        "vllm.io_processor_plugins": {"place_io": "place_io:get"},
    },
    modules={
        "place_general.py": _recorder("general") + "\ndef register():\n    pass\n",
        # Never available: the CPU platform still wins; the probe only says where it ran.
        "place_platform.py": _recorder("platform") + "\ndef probe():\n    return None\n",
        "place_stats.py": _recorder("stat_logger")
        + textwrap.dedent(
            """
            from llmhal.engine.stat_loggers import StatLoggerBase

            class Recorder(StatLoggerBase):
                def __init__(self, config, engine_index=0):
                    pass

                def record(self, scheduler_stats, iteration_stats):
                    pass

                def log_engine_initialized(self):
                    pass
            """
        ),
        "place_io.py": _recorder("io_processor")
        + '\ndef get():\n    return "llmhal.pooling.similarity:SimilarityRanking"\n',
    },
)
GROUPS = ("general", "platform", "stat_logger", "io_processor")


def _placement(folder: Path) -> dict[str, set[int]]:
    """group -> the process ids that imported its plugin."""
    out: dict[str, set[int]] = {g: set() for g in GROUPS}
    for f in folder.iterdir():
        group, pid = f.name.rsplit(".", 1)
        out[group].add(int(pid))
    return out


def _check(placement: dict[str, set[int]], first: int, others: list[int]) -> None:
    assert placement["general"] == {first, *others}
    assert placement["platform"] == {first, *others}
    assert placement["stat_logger"] == {first}
    assert placement["io_processor"] == {first}


@pytest.fixture
def placement(request, tmp_path, monkeypatch):
    root = request.getfixturevalue("install_dists")(PLACEMENT_DIST)
    folder = tmp_path / "placement"
    folder.mkdir()
    monkeypatch.setenv(PLACE_ENV, str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))  # fmt: skip
    return root, folder


def _run(folder: str, **kwargs) -> list[int]:
    from llmhal import LLM

    llm = LLM(folder, kv_cache_memory_bytes=1 << 20, io_processor_plugin="place_io", **kwargs)
    try:
        llm.generate(["hello"], use_tqdm=False)
        pids = llm.engine.executor.worker_pids if kwargs else []
    finally:
        llm.shutdown()
    return pids


def test_uni_loads_every_group_in_its_one_process(placement, tiny_models):
    folder, _ = tiny_models("llama")
    _run(folder)
    _check(_placement(placement[1]), os.getpid(), [])


def test_mp_workers_load_general_and_platform_plugins_only(placement, tiny_models):
    folder, _ = tiny_models("llama")
    workers = _run(folder, tensor_parallel_size=2)
    assert len(workers) == 1 and workers[0] != os.getpid()
    _check(_placement(placement[1]), os.getpid(), workers)


@pytest.mark.slow
def test_ray_actors_load_general_and_platform_plugins_only(placement, tiny_models):
    ray = pytest.importorskip("ray")
    folder, _ = tiny_models("llama")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        workers = _run(folder, tensor_parallel_size=2, distributed_executor_backend="ray")
    finally:
        ray.shutdown()
    _check(_placement(placement[1]), os.getpid(), workers)


_TORCHRUN_SCRIPT = """
import os, sys
from llmhal import LLM
llm = LLM(sys.argv[1], kv_cache_memory_bytes=1 << 20, tensor_parallel_size=2,
          distributed_executor_backend="external_launcher", io_processor_plugin="place_io")
llm.generate(["hello"], use_tqdm=False)
# A file per rank: the ranks share torchrun's stdout, where their lines can interleave.
with open(os.path.join(sys.argv[2], "rank" + os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
llm.shutdown()
"""


@pytest.mark.slow
def test_external_launcher_rank0_alone_loads_process0_plugins(placement, tiny_models, tmp_path):
    from llmhal.distributed.launch import free_port

    folder, _ = tiny_models("llama")
    script = tmp_path / "run.py"
    script.write_text(_TORCHRUN_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), folder,
           str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    pids = {int(f.name.removeprefix("rank")): int(f.read_text()) for f in out.iterdir()}
    assert sorted(pids) == [0, 1]
    _check(_placement(placement[1]), pids[0], [pids[1]])
