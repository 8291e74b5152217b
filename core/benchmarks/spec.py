"""``llmhal bench spec``: speculative decoding against plain decoding, in one run.

The default model runs without speculation and with each method, greedy, on two workloads:

* ``repetitive``: rewrite or continue a given passage (code and prose), where drafting from the
  context should win;
* ``chat``: open questions, where drafts rarely match.

at batch 1 and batch 8. The runs are interleaved (every method once, then again), so a shared
host's drifting speed hits each alike; each figure is the best of ``--repeat`` runs. Reported per
method: decode tokens/s, the speedup over plain decoding in this run, the mean acceptance length,
and whether every output equals the plain one token for token (it must: greedy speculation is
lossless).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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
# Few drafts a step: on the CPU a verified chunk of q tokens costs more than one decode (the
# quantized matmuls' work grows with the rows; SmolLM2 Q4_1 layers cost ~1.3x at q=2, ~2x at q=4),
# so long drafts pay only when nearly all are accepted. Requests whose drafts mostly fail stop
# speculating (llmhal's adaptive switch), so open chat does not pay for failed drafts.
_ADAPTIVE = {
    "disable_below_acceptance_rate": 0.3,
    "min_drafts_before_disable": 8,
    # From 4 running requests on, a step's rows already keep the CPU's matmuls busy (and drafts of
    # different lengths cannot replay a recorded step): batch 8 ran 0.45-0.7x with drafts.
    "disable_by_batch_size": 4,
}
_NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}  # fmt: skip
DEFAULT_METHODS = {
    "ngram": {**_NGRAM, **_ADAPTIVE},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4, **_ADAPTIVE},
}


def workloads(llm: Any) -> dict[str, list[dict[str, Any]]]:
    rep = [t.format(p=p) for p in PASSAGES for t in REPETITIVE]
    return {
        "repetitive": [llm.chat_prompt([{"role": "user", "content": c}]) for c in rep],
        "chat": [llm.chat_prompt([{"role": "user", "content": c}]) for c in CHAT],
    }


def _run(llm: Any, prompts: list[dict[str, Any]], params: Any) -> tuple[float, list[list[int]], tuple[int, int]]:  # fmt: skip
    """(decode tokens/s, token ids per prompt, (drafts, accepted) during the run)."""
    spec = llm.engine.speculator
    before = (spec.stats.num_drafts, spec.stats.num_accepted_tokens) if spec else (0, 0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    ids = [o.outputs[0].token_ids for o in outs]
    after = (spec.stats.num_drafts, spec.stats.num_accepted_tokens) if spec else (0, 0)
    return sum(map(len, ids)) / dt, ids, (after[0] - before[0], after[1] - before[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="llmhal bench spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="default: the default model")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per figure (best counts)")
    p.add_argument("--workloads", default="repetitive,chat")
    p.add_argument(
        "--methods",
        help="JSON object name -> speculative_config (default: ngram and suffix, vLLM's shapes)",
    )
    p.add_argument("--json", dest="json_path", help="also write the results here")
    a = p.parse_args(argv)
    from llmhal import LLM, SamplingParams

    methods = json.loads(a.methods) if a.methods else DEFAULT_METHODS
    kw = {"kv_cache_memory_bytes": 96 << 20, "load_progress": False}
    llms = {"plain": LLM(a.model, **kw)}
    for name, cfg in methods.items():
        llms[name] = LLM(a.model, speculative_config=cfg, **kw)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    loads = workloads(llms["plain"])
    rows = []
    for wl in a.workloads.split(","):
        for batch in (int(b) for b in a.batch_sizes.split(",")):
            prompts = (loads[wl] * batch)[:batch] if batch > len(loads[wl]) else loads[wl][:batch]
            best: dict[str, float] = {}
            ids: dict[str, list[list[int]]] = {}
            drafts: dict[str, tuple[int, int]] = {}
            for _ in range(max(1, a.repeat)):
                for name, llm in llms.items():
                    tps, out, d = _run(llm, prompts, params)
                    best[name] = max(best.get(name, 0.0), tps)
                    ids[name] = out
                    drafts[name] = d
            for name in llms:
                n_drafts, accepted = drafts[name]
                rows.append({
                    "workload": wl, "batch": batch, "method": name,
                    "tokens_per_s": round(best[name], 1),
                    "speedup": round(best[name] / best["plain"], 2),
                    "mean_acceptance_length": round(1 + accepted / n_drafts, 2) if n_drafts else None,  # fmt: skip
                    "drafts": n_drafts,
                    "same_output": ids[name] == ids["plain"],
                })  # fmt: skip
                r = rows[-1]
                print(
                    f"{wl:<11} batch {batch:<2} {name:<8} {r['tokens_per_s']:>7.1f} tok/s  "
                    f"x{r['speedup']:<5} accept-len {r['mean_acceptance_length'] or '-':<5} "
                    f"drafts {n_drafts:<5} same={r['same_output']}",
                    flush=True,
                )
    if a.json_path:
        with open(a.json_path, "w", encoding="utf-8") as f:
            json.dump({"max_tokens": a.max_tokens, "rows": rows}, f, indent=1)
    return 0 if all(r["same_output"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
