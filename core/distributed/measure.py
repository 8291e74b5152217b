"""Measure the collectives of a tensor-parallel decode step: calls, bytes and time per step.

``python -m llmhal.distributed.measure [--model PATH] [--tp 2] [--batch 1 8] [--steps 16]``
starts ``tp`` local ranks over gloo (:mod:`llmhal.distributed.launch`), loads the model's shard on
each the way the engine does, prefills a batch of short prompts, then times decode steps with the
collective counters on (:mod:`llmhal.distributed.stats`). Printed per batch size: the mean step
time, and per step the all-reduce and all-gather calls, their payload bytes and the time spent
inside them (rank 0's view; every rank takes part in every call, and the time includes waiting for
the slower rank), and first the median latency of bare all-reduces of a few sizes.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def _rank(rank: int, model: str | None, batches: list[int], steps: int) -> dict[str, Any]:
    import torch

    from llmhal.default_model import default_model_path
    from llmhal.distributed import get_tp_group
    from llmhal.distributed.stats import record_collectives
    from llmhal.engine.builder import EngineArgs, load_model, resolve_engine_config
    from llmhal.model_loader.source import resolve_source
    from llmhal.platforms import get_current_platform
    from llmhal.testing.model_parity import PagedRunner

    tp = get_tp_group().world_size
    args = EngineArgs(model=model, max_model_len=512, tensor_parallel_size=tp)
    args.distributed_executor_backend = "mp" if tp > 1 else None
    source = resolve_source(model or default_model_path())
    config, ckpt, cls = resolve_engine_config(args, get_current_platform(), source)
    net = load_model(config, ckpt, cls).model
    out: dict[str, Any] = {}
    for batch in batches:
        runner = PagedRunner(net, config, num_blocks=8 * batch + 8)
        prompts = [(i, [5 + i, 17, 42, 99, 7, 11, 13, 200 + i]) for i in range(batch)]
        last = runner.step(prompts)
        times = []
        with record_collectives() as stats:
            for _ in range(steps):
                t0 = time.perf_counter()
                last = runner.step([(rid, [int(v.argmax())]) for rid, v in last.items()])
                times.append(time.perf_counter() - t0)
        per_step = {
            op: {
                "calls": s["calls"] / steps,
                "bytes": s["bytes"] / steps,
                "ms": 1e3 * s["seconds"] / steps,
                "mean_us_per_call": s["mean_us"],
            }
            for op, s in stats.summary().items()
        }
        times.sort()
        out[f"batch {batch}"] = {
            "step_ms_median": 1e3 * times[len(times) // 2],
            "collectives_per_step": per_step,
        }
        del runner
        torch.set_num_threads(1)
    return out


def _latency(rank: int, sizes: list[int], iters: int) -> dict[str, float]:
    """Median all-reduce time of bare float32 tensors of ``sizes`` bytes (no model running): the
    floor a decode step's all-reduces pay on this interconnect."""
    import torch

    from llmhal.distributed import get_tp_group

    g = get_tp_group()
    out = {}
    for size in sizes:
        t = torch.ones(size // 4)
        for _ in range(5):
            g.all_reduce(t)
        times = []
        for _ in range(iters):
            g.barrier()
            t0 = time.perf_counter()
            g.all_reduce(t)
            times.append(time.perf_counter() - t0)
        times.sort()
        out[f"{size} B"] = 1e6 * times[len(times) // 2]
    return out


def main(argv: list[str] | None = None) -> None:
    from llmhal.distributed.launch import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: the default model)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=16)
    a = p.parse_args(argv)
    if a.tp > 1:
        sizes = [1152, 9216, 65536, 1 << 20]
        lat = run_ranks(_latency, a.tp, 1, sizes, 200)
        print("bare all-reduce, median us:", json.dumps(lat[0]))
    results = run_ranks(_rank, a.tp, 1, a.model, a.batch, a.steps)
    print(json.dumps(results[0], indent=2))


if __name__ == "__main__":
    main()
