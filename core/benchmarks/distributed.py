"""``llmhal bench distributed``: decode speed with the model split over ranks, against one process.

For each tensor-parallel size (``--tp``, default 1,2) the model is loaded with the ``mp`` executor
(``uni`` for 1) and decodes ``--new-tokens`` greedy tokens for batches of ``--batch-sizes``
prompts; reported per run: decode tokens/s (the engine's own decode-step clock), and per decode
step the collectives rank 0 ran (calls, bytes per rank, mean latency of one all-reduce, their
share of the step) and what sending the step's inputs to the other ranks cost rank 0 (pickling
and pipe writes; bytes per step). A size the model cannot be split into is reported with the
reason. On a host with fewer cores than ranks, more ranks are not faster: the numbers show what
the collectives and the fan-out cost.

With pipeline stages (``--pp 1,2``) each PP>1 engine is measured twice per batch size, in the same
run, alternating: one batch at a time (``max_concurrent_batches`` 1) and one batch per stage in
flight (see :mod:`llmhal.engine.batch_queue`). Those rows add each stage's busy fraction (its
first rank's compute seconds, the time handing tensors between stages left out, over the run's
wall time) and how many batches were submitted while another was in flight: overlapping stages
show as busy fractions that add up to more than one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

PROMPT = "Write a long story about a lighthouse keeper and the storm that changed everything."


def _sizes(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def measure(model: str | None, tp: int, pp: int, batch_sizes: list[int], new_tokens: int, repeat: int, backend: str | None) -> list[dict[str, Any]]:  # fmt: skip
    """One engine of ``tp`` x ``pp`` ranks; a row per batch size (best of ``repeat`` runs), and
    with ``pp`` > 1 per number of batches in flight (1 and ``pp``)."""
    from llmhal import LLM

    llm = LLM(
        model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
        distributed_executor_backend=backend if tp * pp > 1 else None,
        max_num_seqs=max(batch_sizes),
    )  # fmt: skip
    executor = llm.engine.executor
    modes = [1, executor.max_concurrent_batches] if executor.max_concurrent_batches > 1 else [1]
    rows = []
    try:
        for batch in batch_sizes:
            best: dict[int, dict[str, Any]] = {}
            for _ in range(repeat):
                for in_flight in modes:  # alternating: the same load for both
                    executor.max_concurrent_batches = in_flight
                    row = _run(llm, tp, pp, batch, new_tokens, in_flight)
                    if in_flight not in best or row["decode_tps"] > best[in_flight]["decode_tps"]:
                        best[in_flight] = row
            rows += [best[m] for m in modes]
    finally:
        executor.max_concurrent_batches = modes[-1]
        llm.shutdown()
    return rows


def _run(llm: Any, tp: int, pp: int, batch: int, new_tokens: int, in_flight: int) -> dict[str, Any]:  # fmt: skip
    """One generate() of ``batch`` prompts, and its figures."""
    from llmhal import SamplingParams
    from llmhal.distributed.stats import record_collectives

    engine, executor = llm.engine, llm.engine.executor
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine.stats.__init__()  # a fresh EngineStats
    steps0 = getattr(executor, "steps", 0)
    disp0 = getattr(executor, "dispatch_seconds", 0.0)
    bytes0 = getattr(executor, "dispatch_bytes", 0)
    queue = engine._batch_queue
    overlapped0 = queue.overlapped if queue is not None else 0
    busy0 = executor.stage_busy_seconds() if pp > 1 else []
    t0 = time.perf_counter()
    with record_collectives() as coll:
        llm.generate([PROMPT] * batch, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    st = engine.stats
    steps = max(1, getattr(executor, "steps", 0) - steps0)
    summary = coll.summary()
    reduce = {k: v for k, v in summary.items() if k.startswith("all_reduce/")}
    calls = sum(v["calls"] for v in reduce.values())
    secs = sum(v["seconds"] for v in summary.values())
    row = {
        "tp": tp, "pp": pp, "batch": batch, "in_flight": in_flight,
        "decode_tps": round(st.decode_tps, 2),
        "generated_tps": round(batch * new_tokens / wall, 2),
        "collective_calls_per_step": round(sum(v["calls"] for v in summary.values()) / st.steps, 1),
        "all_reduce_bytes_per_step": round(sum(v["bytes"] for v in reduce.values()) / st.steps),
        "all_reduce_mean_us": round(1e6 * sum(v["seconds"] for v in reduce.values()) / calls, 1) if calls else 0.0,
        "collective_share": round(secs / (st.decode_seconds + st.prefill_seconds), 3) if st.steps else 0.0,
        "dispatch_us_per_step": round(1e6 * (getattr(executor, "dispatch_seconds", 0.0) - disp0) / steps, 1),
        "dispatch_bytes_per_step": round((getattr(executor, "dispatch_bytes", 0) - bytes0) / steps),
        "collectives": summary,
    }  # fmt: skip
    if pp > 1:
        busy = executor.stage_busy_seconds()
        # Each stage's first rank (ranks are stage-major: stage s starts at s * tp).
        row["stage_busy"] = [round((busy[s * tp] - busy0[s * tp]) / wall, 3) for s in range(pp)]
        queue = engine._batch_queue
        row["overlapped_batches"] = (queue.overlapped if queue is not None else 0) - overlapped0
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="llmhal bench distributed", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", help="default: the default model")
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes to compare (default 1,2)")
    p.add_argument(
        "--pp", default="1",
        help="pipeline stage counts to compare (default 1); each PP>1 engine runs one batch at a "
        "time and one per stage in flight",
    )  # fmt: skip
    p.add_argument("--distributed-executor-backend", default="mp", choices=("mp", "ray"))
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2, help="runs per figure (the best counts)")
    p.add_argument("--json", dest="json_path", help="also write the results here")
    a = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for pp in _sizes(a.pp):
        for tp in _sizes(a.tp):
            try:
                rows += measure(a.model, tp, pp, _sizes(a.batch_sizes), a.new_tokens, a.repeat, a.distributed_executor_backend)  # fmt: skip
            except ValueError as e:  # e.g. heads that do not split into tp parts
                failed.append({"tp": tp, "pp": pp, "error": str(e)})
                print(f"llmhal bench distributed: tp={tp} pp={pp}: {e}", file=sys.stderr)
    head = f"{'tp':>3} {'pp':>3} {'batch':>5} {'flight':>6} {'decode tok/s':>12} {'gen tok/s':>9} {'coll/step':>9} {'AR bytes/step':>13} {'AR mean us':>10} {'coll share':>10} {'dispatch us':>11} {'dispatch B':>10} {'stage busy':>11} {'overlap':>7}"  # fmt: skip
    print(head)
    for r in rows:
        busy = "/".join(f"{b:.2f}" for b in r.get("stage_busy", ())) or "-"
        print(
            f"{r['tp']:>3} {r['pp']:>3} {r['batch']:>5} {r['in_flight']:>6} "
            f"{r['decode_tps']:>12.1f} {r['generated_tps']:>9.1f} "
            f"{r['collective_calls_per_step']:>9} {r['all_reduce_bytes_per_step']:>13} "
            f"{r['all_reduce_mean_us']:>10} {r['collective_share']:>10} "
            f"{r['dispatch_us_per_step']:>11} {r['dispatch_bytes_per_step']:>10} "
            f"{busy:>11} {r.get('overlapped_batches', '-'):>7}"
        )
    for f in failed:
        print(f"{f['tp']:>3} {f['pp']:>3}  not run: {f['error']}")
    if a.json_path:
        with open(a.json_path, "w", encoding="utf-8") as fh:
            json.dump({"new_tokens": a.new_tokens, "rows": rows, "not_run": failed}, fh, indent=1)
    return 0
