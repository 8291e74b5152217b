"""``llmhal bench spec``: speculative decoding against plain decoding, in one run.

The default model runs without speculation and with each method, greedy, on two workloads:

* ``repetitive``: rewrite or continue a given passage (code and prose), where drafting from the
  context should win;
* ``chat``: open questions, where drafts rarely match.

at batch 1 (each of the workload's prompts alone, one after another) and batch 8 (the prompts in
one call). The runs are interleaved (every method once, then again), so a shared host's drifting
speed hits each alike; each figure is the best of ``--repeat`` runs. Reported per method: decode
tokens/s, the speedup over plain decoding in this run, the same per second of the process's CPU
time (on a shared host the robust figure; run with ``LLMHAL_NUM_THREADS=1`` for it to count work
only), the mean acceptance length and drafts over all runs, and whether every output equals the
plain one token for token (it must: greedy speculation is lossless).

Methods (``DEFAULT_METHODS``): ``ngram`` and ``suffix`` draft from the context (suffix's cache of
past responses is emptied before each timed run, so no run drafts from its own prompts' earlier
answers); ``draft_model`` drafts with the target's own file (no smaller model with its vocabulary
ships here: the case where drafting costs as much as it saves); ``eagle`` and ``medusa`` run random
heads in the published layouts (no trained head for the default model exists; their drafts fail,
which measures what the adaptive switch saves). ``mtp`` needs a model with MTP layers and
``eagle3``/``dflash`` heads of their own; give them with ``--methods``. Every method stops drafting
for a request whose drafts do not pay for the verification (``disable_when_slower``) and tries
again later (``llmhal.spec_decode.adaptive``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PASSAGES = [
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = len(items) // 2\n"
    "    left = merge_sort(items[:middle])\n    right = merge_sort(items[middle:])\n    merged = []\n"
    "    while left and right:\n        merged.append(left.pop(0) if left[0] <= right[0] else right.pop(0))\n"
    "    return merged + left + right\n",
    "The city council met on Tuesday to discuss the new park. Residents asked for more trees, a "
    "playground for young children, and a quiet area with benches. The council agreed to publish "
    "a plan in the spring and to hold a second meeting before any work begins.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def is_empty(self):\n        return not self.items\n",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is "
    "lower, so water boils at a lower temperature, and food takes longer to cook.",
]
REPETITIVE = [
    "Repeat the following text exactly, word for word:\n\n{p}",
    "Copy this out again without changing anything:\n\n{p}",
]
CHAT = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Give me three tips for learning a new language.",
    "Why is the sky blue?",
    "What should I cook for dinner tonight?",
    "Explain what a neural network is in simple terms.",
    "Tell me a fun fact about octopuses.",
    "How do I stay focused while working from home?",
]
# Drafts sized by the evidence: on the CPU a verified chunk of q tokens costs more than one decode
# (SmolLM2 Q4_1, one thread, whole steps: q=3 ~1.3, q=5 ~1.6, q=7 ~2.0, q=8 ~2.5 decode steps;
# the matmuls' int16 dot products are compute-bound from ~4 rows), so a long draft pays only when
# nearly all of it is accepted. N-gram drafts at most 2 tokens per matched token (a 1-gram match:
# 2, a 3-gram: 6), suffix decoding its default max_spec_factor (1 per matched token), both up to 6
# drafts (q=7; a q=8 step costs more). Replayed offline on this workload's plain outputs at those
# costs, n-gram then needs 125 steps for its 425 tokens (fixed k=4 from 2-grams: 152) and suffix
# 111 (k=4: 128).
_ADAPTIVE = {
    # Stop a request's drafts when its last 4 verifications gave fewer tokens per step than they
    # cost in decode steps (measured as the run goes, per draft length); retry 16 steps on, waiting
    # twice as long after each further stop; once two requests in a row were stopped, new requests
    # start stopped (llmhal.spec_decode.adaptive).
    "disable_when_slower": True,
    "min_drafts_before_disable": 4,
    "retry_after_steps": 16,
    # From 4 running requests on, a step's rows already keep the CPU's matmuls busy (and drafts of
    # different lengths cannot replay a recorded step): batch 8 ran 0.45-0.7x with drafts.
    "disable_by_batch_size": 4,
}
# Drafting from the context costs ~60 us a step, so n-gram and suffix retry after 4 steps: their
# drafts fail at the start of an answer ("Sure! Here is ...") and pay once it starts copying, and a
# 16-step wait lost 6-10% of the repetitive workload's speedup. The heavy proposers keep 16: at 4,
# their retries (a draft model as costly as the target, random heads) cost chat 0.80-0.93x.
_CHEAP_ADAPTIVE = {**_ADAPTIVE, "retry_after_steps": 4}
_NGRAM = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 8, "prompt_lookup_max_spec_factor": 2}  # fmt: skip
DEFAULT_METHODS: dict[str, dict[str, Any]] = {
    "ngram": {**_NGRAM, **_CHEAP_ADAPTIVE},
    "suffix": {"method": "suffix", "num_speculative_tokens": 6, **_CHEAP_ADAPTIVE},
    # "model" filled in by _with_models: the target's own file, random heads.
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 2, **_ADAPTIVE},
    "eagle": {"method": "eagle", "num_speculative_tokens": 2, **_ADAPTIVE},
    "medusa": {"method": "medusa", "num_speculative_tokens": 2, **_ADAPTIVE},
}


def _with_models(methods: dict[str, dict[str, Any]], target: str, hf_config: Any, tmp: Path) -> dict[str, dict[str, Any]]:  # fmt: skip
    """``methods`` with ``model`` set where a default method needs one and none was given."""
    from llmhal.benchmarks.spec_heads import random_eagle_head, random_medusa_heads

    makers = {
        "draft_model": lambda: target,
        "eagle": lambda: str(random_eagle_head(tmp / "eagle", hf_config)),
        "medusa": lambda: str(random_medusa_heads(tmp / "medusa", hf_config)),
    }
    out = {}
    for name, cfg in methods.items():
        cfg = dict(cfg)
        if cfg.get("model") is None and cfg.get("method") in makers:
            cfg["model"] = makers[cfg["method"]]()
        out[name] = cfg
    return out


def _methods(arg: str | None) -> dict[str, dict[str, Any]]:
    """``--methods``: a JSON object name -> speculative_config, or default method names."""
    if not arg:
        return DEFAULT_METHODS
    if arg.lstrip().startswith("{"):
        return json.loads(arg)
    names = [n.strip() for n in arg.split(",") if n.strip()]
    unknown = [n for n in names if n not in DEFAULT_METHODS]
    if unknown:
        raise SystemExit(f"--methods: {', '.join(unknown)} not among {', '.join(DEFAULT_METHODS)}; give a JSON object for others")  # fmt: skip
    return {n: DEFAULT_METHODS[n] for n in names}


def workloads(llm: Any) -> dict[str, list[dict[str, Any]]]:
    rep = [t.format(p=p) for p in PASSAGES for t in REPETITIVE]
    return {
        "repetitive": [llm.chat_prompt([{"role": "user", "content": c}]) for c in rep],
        "chat": [llm.chat_prompt([{"role": "user", "content": c}]) for c in CHAT],
    }


def _run(llm: Any, prompts: list[dict[str, Any]], params: Any, batch: int) -> tuple[tuple[float, float], list[list[int]], tuple[int, int]]:  # fmt: skip
    """((decode tokens/s, tokens per CPU second), token ids per prompt, (drafts, accepted) during
    the run). At batch 1 each prompt runs alone, one after another."""
    spec = llm.engine.speculator
    forget = getattr(spec.proposer, "forget_past", None) if spec else None
    if forget is not None:
        forget()
    before = (spec.stats.num_drafts, spec.stats.num_accepted_tokens) if spec else (0, 0)
    groups = [[p] for p in prompts] if batch == 1 else [prompts]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = [o for g in groups for o in llm.generate(g, params, use_tqdm=False)]
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    ids = [o.outputs[0].token_ids for o in outs]
    after = (spec.stats.num_drafts, spec.stats.num_accepted_tokens) if spec else (0, 0)
    n = sum(map(len, ids))
    return (n / dt, n / cpu), ids, (after[0] - before[0], after[1] - before[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="llmhal bench spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="default: the default model")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompts", type=int, default=8, help="prompts per workload at batch 1 (each alone)")  # fmt: skip
    p.add_argument("--repeat", type=int, default=2, help="timed runs per figure (best counts)")
    p.add_argument("--workloads", default="repetitive,chat")
    p.add_argument(
        "--methods",
        help=f"JSON object name -> speculative_config, or some of {','.join(DEFAULT_METHODS)} (default: all)",  # fmt: skip
    )
    p.add_argument("--json", dest="json_path", help="also write the results here")
    a = p.parse_args(argv)
    from llmhal import LLM
    from llmhal.default_model import default_model_path

    kw = {"kv_cache_memory_bytes": 96 << 20, "load_progress": False}
    llms = {"plain": LLM(a.model, **kw)}
    target = a.model or default_model_path()
    with tempfile.TemporaryDirectory(prefix="llmhal-bench-spec-") as tmp:
        hf = llms["plain"].engine.config.model.hf_config
        for name, cfg in _with_models(_methods(a.methods), target, hf, Path(tmp)).items():
            llms[name] = LLM(a.model, speculative_config=cfg, **kw)
        rows = _measure(llms, a)
    if a.json_path:
        with open(a.json_path, "w", encoding="utf-8") as f:
            json.dump({"max_tokens": a.max_tokens, "rows": rows}, f, indent=1)
    return 0 if all(r["same_output"] for r in rows) else 1


def _measure(llms: dict[str, Any], a: argparse.Namespace) -> list[dict[str, Any]]:
    from llmhal import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    loads = workloads(llms["plain"])
    rows = []
    for wl in a.workloads.split(","):
        for batch in (int(b) for b in a.batch_sizes.split(",")):
            n = a.prompts if batch == 1 else batch
            prompts = (loads[wl] * n)[:n]
            best: dict[str, float] = {}
            best_cpu: dict[str, float] = {}
            ids: dict[str, list[list[int]]] = {}
            drafts: dict[str, tuple[int, int]] = {}
            for _ in range(max(1, a.repeat)):
                for name, llm in llms.items():
                    (tps, per_cpu), out, d = _run(llm, prompts, params, batch)
                    best[name] = max(best.get(name, 0.0), tps)
                    best_cpu[name] = max(best_cpu.get(name, 0.0), per_cpu)
                    ids[name] = out
                    drafts[name] = (drafts.get(name, (0, 0))[0] + d[0], drafts.get(name, (0, 0))[1] + d[1])  # fmt: skip
            for name in llms:
                n_drafts, accepted = drafts[name]
                rows.append({
                    "workload": wl, "batch": batch, "method": name,
                    "tokens_per_s": round(best[name], 1),
                    "speedup": round(best[name] / best["plain"], 2),
                    # Tokens per second of this process's CPU time: on a shared host, where wall
                    # time also measures the neighbours, the work itself (one thread: the
                    # spinning of idle OpenMP threads counts too with more).
                    "tokens_per_cpu_s": round(best_cpu[name], 1),
                    "cpu_speedup": round(best_cpu[name] / best_cpu["plain"], 2),
                    "mean_acceptance_length": round(1 + accepted / n_drafts, 2) if n_drafts else None,  # fmt: skip
                    "drafts": n_drafts,
                    "same_output": ids[name] == ids["plain"],
                })  # fmt: skip
                r = rows[-1]
                print(
                    f"{wl:<11} batch {batch:<2} {name:<11} {r['tokens_per_s']:>7.1f} tok/s  "
                    f"x{r['speedup']:<5} cpu x{r['cpu_speedup']:<5} "
                    f"accept-len {r['mean_acceptance_length'] or '-':<5} "
                    f"drafts {n_drafts:<5} same={r['same_output']}",
                    flush=True,
                )
    return rows


if __name__ == "__main__":
    sys.exit(main())
