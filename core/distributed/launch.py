"""Run a function on N local ranks (spawned processes, one world over 127.0.0.1): for tests and
measurements. Executors (``llmhal.executor``) start real workers; this is the bare minimum that
gives each process ``init_distributed`` and collects what the function returns.
"""

from __future__ import annotations

import pickle
import socket
from collections.abc import Callable, Sequence
from typing import Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _where(fn: Callable[..., Any]) -> tuple[str, str, str]:
    import inspect

    return fn.__module__, fn.__qualname__, inspect.getfile(fn)


def _resolve(where: tuple[str, str, str]) -> Callable[..., Any]:
    """The function in the child: by module name, else from its file (a test module imported by
    pytest's importlib mode is not importable by name from a fresh process)."""
    import importlib
    import importlib.util
    import sys

    module_name, qualname, path = where
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        module = None
    if module is None or getattr(module, "__file__", None) != path:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {qualname} from {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _entry(
    rank: int,
    where: tuple[str, str, str],
    world: int,
    tp: int,
    pp: int,
    init: str,
    backend: str | None,
    args: Sequence[Any],
    results: Any,
) -> None:
    import torch

    from llmhal.distributed.parallel_state import destroy_distributed, init_distributed

    # Two ranks on a shared host: one thread each keeps them from fighting over the cores.
    torch.set_num_threads(1)
    fn = _resolve(where)
    init_distributed(world, rank, init, tp, pp, backend=backend)
    try:
        # Pickled here, by value: torch's queue pickler would share tensors through file
        # descriptors that vanish when this process exits.
        results.put((rank, pickle.dumps(fn(rank, *args))))
    finally:
        destroy_distributed()


def run_ranks(
    fn: Callable[..., Any],
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    *args: Any,
    backend: str | None = "gloo",
    timeout: float = 600.0,
) -> list[Any]:
    """``fn(rank, *args)`` on every rank of a ``tp x pp`` world; returns the ranks' results in
    rank order. ``fn`` must be importable by name (a module-level function) and its result
    picklable. A rank that raises makes this raise (torch.multiprocessing's ProcessRaisedException
    carries the rank's traceback; the other ranks are stopped). Ranks still running after
    ``timeout`` seconds (a collective some rank never joined) are killed and TimeoutError raised."""
    import time

    import torch.multiprocessing as mp

    world = tensor_parallel_size * pipeline_parallel_size
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = mp.start_processes(
        _entry,
        args=(
            _where(fn),
            world,
            tensor_parallel_size,
            pipeline_parallel_size,
            init,
            backend,
            args,
            results,
        ),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    out: dict[int, Any] = {}
    # Drain while waiting: a result larger than the pipe's buffer blocks its sender until read.
    done = False
    deadline = time.monotonic() + timeout
    while not done:
        if time.monotonic() > deadline:
            for p in procs.processes:
                if p.is_alive():
                    p.kill()
                p.join()
            raise TimeoutError(f"{fn.__qualname__} on {world} ranks ran past {timeout:.0f} s")
        done = procs.join(timeout=0.05)
        while not results.empty():
            rank, value = results.get()
            out[rank] = pickle.loads(value)
    return [out[r] for r in range(world)]
