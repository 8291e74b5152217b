"""Faults in a multi-process engine (issue 24): a rank that dies or raises fails the engine with an
error naming the rank and the cause, every other process exits, nothing hangs and nothing is
orphaned; the engine's own death (even SIGKILL) and Ctrl-C take its workers with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from llmhal import LLM, SamplingParams
from llmhal.executor.base import EngineDeadError
from llmhal.testing.distributions import FakeDistribution
from llmhal.testing.processes import wait_gone

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
BOUND_S = 15.0  # how long the survivors may take to go


def _kill_mid_generation(llm: LLM, rank: int) -> EngineDeadError:
    """Start a long request, let it run a few steps, SIGKILL ``rank``; the error the engine
    raises (within the bound)."""
    engine = llm.engine
    engine.add_request("The quick brown fox", LONG)
    for _ in range(3):
        engine.step()
    os.kill(llm.engine.executor.worker_pids[rank - 1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError) as caught:
        while time.monotonic() - t0 < 60:
            engine.step()
    assert time.monotonic() - t0 < BOUND_S
    return caught.value


def test_killed_worker_fails_the_engine_naming_rank_and_signal(tiny_models):
    folder, _ = tiny_models("llama")
    llm = LLM(folder, kv_cache_memory_bytes=4 << 20, tensor_parallel_size=2)
    try:
        err = _kill_mid_generation(llm, rank=1)
        assert err.rank == 1 and "SIGKILL" in str(err), err
        with pytest.raises(EngineDeadError, match="rank 1"):  # dead for good, at once
            llm.generate(["again"], use_tqdm=False)
    finally:
        llm.shutdown()


def test_killed_last_stage_with_two_batches_in_flight(tiny_models):
    """PP=2 with both stages holding a batch (llmhal.engine.batch_queue): SIGKILL the last stage;
    the engine fails naming rank 1 within the bound, for good, and no worker is left."""
    folder, _ = tiny_models("llama")
    llm = LLM(folder, kv_cache_memory_bytes=4 << 20, pipeline_parallel_size=2)
    try:
        engine = llm.engine
        for prompt in ("The quick brown fox", "def add(a, b):", "1, 2, 3, 4,", "Once upon"):
            engine.add_request(prompt, LONG)
        for _ in range(4):
            engine.step()
        executor, pids = engine.executor, engine.executor.worker_pids
        collect, in_flight = executor._collect, []

        def kill_then_collect(*args):
            # The batch being collected plus those still queued: what the pipeline holds.
            in_flight.append(1 + len(engine._batch_queue.pending))
            os.kill(pids[0], signal.SIGKILL)
            return collect(*args)

        executor._collect = kill_then_collect
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError) as caught:
            while time.monotonic() - t0 < 60:
                engine.step()
        assert time.monotonic() - t0 < BOUND_S
        assert caught.value.rank == 1 and "SIGKILL" in str(caught.value), caught.value
        assert in_flight == [2]
        with pytest.raises(EngineDeadError, match="rank 1"):
            llm.generate(["again"], use_tqdm=False)
        wait_gone(pids, BOUND_S)
    finally:
        llm.shutdown()


def rank1_plugin(name: str, body: str) -> FakeDistribution:
    """A general plugin whose ``register()`` runs ``body`` (Python, dedented) in rank 1's process
    only: the fault it injects hits that rank alone."""
    module = name.replace("-", "_")
    source = (
        "import multiprocessing\n\n\ndef register():\n"
        "    if multiprocessing.current_process().name != 'llmhal-rank1':\n"
        "        return\n" + textwrap.indent(textwrap.dedent(body), "    ")
    )
    return FakeDistribution(
        name,
        entry_points={"vllm.general_plugins": {module: f"{module}:register"}},
        modules={f"{module}.py": source},
    )


# Rank 1's 4th step raises.
RAISER = rank1_plugin(
    "fault-injector",
    """
    from llmhal.engine.model_runner import ModelRunner

    original, calls = ModelRunner.run, [0]

    def run(self, step):
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("injected fault")
        return original(self, step)

    ModelRunner.run = run
    """,
)


@pytest.mark.parametrize(
    "layout, prompts",
    [
        ({"tensor_parallel_size": 2}, 1),
        # The last stage raises while rank 0 pipelines batches of the 4 requests.
        pytest.param({"pipeline_parallel_size": 2}, 4, marks=pytest.mark.slow),
    ],
)
def test_worker_that_raises_fails_the_engine_with_its_error(request, tiny_models, layout, prompts):
    request.getfixturevalue("install_dists")(RAISER)
    folder, _ = tiny_models("llama")
    llm = LLM(folder, kv_cache_memory_bytes=4 << 20, **layout)
    try:
        pid = llm.engine.executor.worker_pids[0]
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError) as caught:
            llm.generate(["The quick brown fox"] * prompts, LONG, use_tqdm=False)
        assert time.monotonic() - t0 < BOUND_S
        assert caught.value.rank == 1
        assert "raised RuntimeError: injected fault" in str(caught.value)
        wait_gone([pid], BOUND_S)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_killed_worker_takes_down_every_other_rank(tiny_models):
    """TP=2 x PP=2: rank 1 killed mid-generation; ranks 2 and 3 exit too."""
    folder, _ = tiny_models("llama")
    llm = LLM(
        folder, kv_cache_memory_bytes=4 << 20, tensor_parallel_size=2, pipeline_parallel_size=2
    )
    try:
        pids = llm.engine.executor.worker_pids
        err = _kill_mid_generation(llm, rank=1)
        assert err.rank == 1 and "SIGKILL" in str(err), err
        wait_gone(pids, BOUND_S)
    finally:
        llm.shutdown()


# Rank 1 reports 'joining', then dies before connecting.
DIES_JOINING = rank1_plugin(
    "dies-joining",
    """
    import os

    import llmhal.executor.worker as worker

    worker.join_process_group = lambda *args: os._exit(3)
    """,
)


@pytest.mark.slow
def test_worker_dying_between_joining_and_connecting_fails_at_once(request, tiny_models, monkeypatch):  # fmt: skip
    """Rank 0 is waiting in init_process_group for every rank to connect: a worker that dies
    there fails the engine, naming it, once the join's bound has passed (not torch's 30-minute
    init timeout), and the failed join leaves this process able to build another engine."""
    import llmhal.executor.mp as mp

    monkeypatch.setattr(mp, "_JOIN_TIMEOUT_S", 5.0)  # 60 s by default
    from torch.distributed import distributed_c10d

    request.getfixturevalue("install_dists")(DIES_JOINING)
    folder, _ = tiny_models("llama")
    groups = distributed_c10d._world.group_count
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError) as caught:
        LLM(folder, kv_cache_memory_bytes=4 << 20, tensor_parallel_size=2)
    assert time.monotonic() - t0 < BOUND_S + 20  # the worker's start-up (imports) included
    assert caught.value.rank == 1
    assert "exited with status 3 while joining the process group" in str(caught.value)
    # torch names the next default group after its count of groups: the failed join's must not
    # count, or the next engine's ranks would wait for each other under different names.
    assert distributed_c10d._world.group_count == groups


_ENGINE_SCRIPT = textwrap.dedent(
    """
    import sys
    from llmhal import LLM, SamplingParams

    if __name__ == "__main__":  # spawned workers import this script: they must not run it
        llm = LLM(sys.argv[1], kv_cache_memory_bytes=4 << 20, tensor_parallel_size=2)
        print("PIDS", *llm.engine.executor.worker_pids, flush=True)
        while True:
            llm.generate(["The quick brown fox"], SamplingParams(max_tokens=400, ignore_eos=True),
                         use_tqdm=False)
    """
)


def _start_engine(folder: str, tmp_path) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "engine.py"
    script.write_text(_ENGINE_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), folder],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's job would be
    )
    line = proc.stdout.readline()
    assert line.startswith("PIDS"), proc.stderr.read()[-3000:]
    time.sleep(1.0)  # generating
    return proc, [int(p) for p in line.split()[1:]]


@pytest.mark.slow
def test_engine_killed_leaves_no_orphaned_worker(tiny_models, tmp_path):
    folder, _ = tiny_models("llama")
    proc, workers = _start_engine(folder, tmp_path)
    proc.kill()  # SIGKILL: no clean-up code of the engine's runs
    proc.wait(10)
    wait_gone(workers, BOUND_S)


@pytest.mark.slow
def test_ctrl_c_stops_the_engine_and_its_workers(tiny_models, tmp_path):
    folder, _ = tiny_models("llama")
    proc, workers = _start_engine(folder, tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the terminal's whole process group
    try:
        proc.wait(BOUND_S)
    finally:
        proc.kill()
    _, err = proc.communicate()
    assert "KeyboardInterrupt" in err
    wait_gone(workers, BOUND_S)


def test_ctrl_c_mid_step_ends_the_engine_instead_of_desynchronising_it(tiny_models):
    """A KeyboardInterrupt caught by the caller (a notebook) leaves the other ranks inside the
    step's collectives: the engine must refuse further steps, not hang in the next one."""
    folder, _ = tiny_models("llama")
    llm = LLM(folder, kv_cache_memory_bytes=4 << 20, tensor_parallel_size=2)
    try:
        pid = llm.engine.executor.worker_pids[0]
        runner, calls = llm.engine.runner, [0]
        original = runner.run

        def interrupted(step):
            calls[0] += 1
            if calls[0] == 3:  # the worker has this step and waits in its collectives
                raise KeyboardInterrupt
            return original(step)

        runner.run = interrupted
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["The quick brown fox"], LONG, use_tqdm=False)
        with pytest.raises(EngineDeadError, match="rank 0 .* interrupted"):
            llm.generate(["again"], use_tqdm=False)
        wait_gone([pid], BOUND_S)
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_killed_ray_actor_fails_the_engine_naming_its_rank(tiny_models, tp, pp):
    """The ``ray`` backend: rank 1's actor SIGKILLed mid-generation (with PP=2, while a batch is
    in the pipeline) fails the engine naming rank 1 and its actor's death, within the bound, and
    for good."""
    ray = pytest.importorskip("ray")
    folder, _ = tiny_models("llama")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(folder, kv_cache_memory_bytes=4 << 20, tensor_parallel_size=tp,
                  pipeline_parallel_size=pp, distributed_executor_backend="ray")  # fmt: skip
        try:
            pid = llm.engine.executor.worker_pids[0]
            err = _kill_mid_generation(llm, rank=1)
            assert err.rank == 1 and "Ray actor died" in str(err), err
            with pytest.raises(EngineDeadError, match="rank 1"):
                llm.generate(["again"], use_tqdm=False)
            wait_gone([pid], BOUND_S)
        finally:
            llm.shutdown()
    finally:
        ray.shutdown()
