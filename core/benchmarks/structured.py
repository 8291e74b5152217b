"""``llmhal bench structured``: decode tokens/s under a JSON-schema constraint against the same
requests unconstrained, per structured-output backend and batch size, in one run.

One engine (the default model unless ``--model``) serves every row; each backend gets its own
structured-output manager on it in turn. Greedy requests on the model's chat template ask for a
person as JSON; the constrained ones follow ``SCHEMA`` (free strings, an array, a number and a
boolean: what all four backends enforce), compactly. Before timing, each backend serves the
largest batch once, so its one-time costs (starting the backend, compiling the schema: cached
afterwards) fall outside the table, which measures the per-token cost: the mask each step
(filling it, applying it to the logits) and advancing each grammar. Each figure is the best of
``--repeat`` runs; the loss is the constraint's share of the CPU time, median over ``--repeat``
back-to-back pairs (a constrained run, then the same prompts unconstrained for as many tokens):
on a busy shared host wall-clock rates swing by tens of percent between runs, CPU time far less.
Run it with ``OMP_NUM_THREADS=1 LLMHAL_NUM_THREADS=1`` for CPU times free of thread spinning.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 6},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "city", "hobbies", "score", "active"],
    "additionalProperties": False,
}
BACKENDS = ("xgrammar", "guidance", "outlines", "lm-format-enforcer")
QUESTIONS = [
    "Describe a made-up person as JSON: name, city, hobbies, score, active.",
    "Invent a character and give their profile as JSON.",
    "Write a JSON record for a fictional athlete.",
    "Give me a JSON profile of a musician from Paris.",
]


def _run(a: argparse.Namespace) -> dict[str, Any]:
    from llmhal import LLM, SamplingParams
    from llmhal.structured_output import StructuredOutputsParams
    from llmhal.structured_output.manager import StructuredOutputManager, check_backend_name

    llm = LLM(a.model, max_num_seqs=max(a.batch_sizes), enable_prefix_caching=False, load_progress=False)  # fmt: skip
    engine = llm.engine
    tok = llm.get_tokenizer()
    vocab = getattr(engine.config.model.hf_config, "vocab_size", None) or len(tok)

    def prompts(b: int) -> list[dict[str, Any]]:
        msgs = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(b)]
        return [{"prompt": llm.apply_chat_template(m)} for m in msgs]

    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    constrained = SamplingParams(temperature=0, max_tokens=a.new_tokens, structured_outputs=so)
    plain = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)

    def run(b: int, params: SamplingParams | list[SamplingParams]) -> dict[str, Any]:
        engine.stats.__init__()
        cpu = time.process_time()
        outs = llm.generate(prompts(b), params, use_tqdm=False)
        cpu = time.process_time() - cpu
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        return {"tokens_per_s": engine.stats.decode_tps, "lengths": lengths, "cpu_s": cpu}

    def paired(b: int) -> dict[str, Any]:
        """``--repeat`` pairs: a constrained run, then the same prompts unconstrained for exactly
        as many tokens each, back to back. Wall-clock decode rates (best of each), and the loss
        from the pairs' CPU time (median), which a busy shared host inflates far less than wall
        time: same prompts, same token counts, so the difference is the constraint's own work."""
        pairs = []
        for _ in range(max(1, a.repeat)):
            con = run(b, constrained)
            same = [SamplingParams(temperature=0, max_tokens=max(1, n), ignore_eos=True) for n in con["lengths"]]  # fmt: skip
            pairs.append((run(b, same), con))
        losses = [1 - p["cpu_s"] / c["cpu_s"] for p, c in pairs if c["cpu_s"]]
        return {
            "unconstrained": {"tokens_per_s": max(p["tokens_per_s"] for p, _ in pairs), "cpu_s": min(p["cpu_s"] for p, _ in pairs)},
            "constrained": {"tokens_per_s": max(c["tokens_per_s"] for _, c in pairs), "cpu_s": min(c["cpu_s"] for _, c in pairs),
                            "tokens": sum(pairs[0][1]["lengths"])},
            "loss": statistics.median(losses), "losses": losses,
        }  # fmt: skip

    result: dict[str, Any] = {"model": a.model, "new_tokens": a.new_tokens, "rows": []}
    llm.generate(prompts(max(a.batch_sizes)), plain, use_tqdm=False)  # untimed: steady state
    for name in a.backends:
        try:
            check_backend_name(name)
        except Exception as e:  # a library not installed: say so in the table
            result["rows"].append({"backend": name, "error": str(e)})
            continue
        engine._structured = StructuredOutputManager(tok, vocab, engine.eos_token_ids, name)
        llm.generate(prompts(max(a.batch_sizes)), constrained, use_tqdm=False)  # untimed
        for b in a.batch_sizes:
            row = {"backend": name, "batch": b, **paired(b)}
            result["rows"].append(row)
            print(_line(row), file=sys.stderr, flush=True)
    return result


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['backend']:<20} unavailable: {row['error']}"
    base, con = row["unconstrained"]["tokens_per_s"], row["constrained"]["tokens_per_s"]
    spread = f"{min(row['losses']) * 100:.0f}..{max(row['losses']) * 100:.0f}%"
    return f"{row['backend']:<20} {row['batch']:>5} {base:>10.1f} {con:>10.1f} {row['loss'] * 100:>7.1f}% {spread:>12}"  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="llmhal bench structured", description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--model", default=None, help="model path (default: the default model)")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", dest="json_path", help="also write the results here")
    a = p.parse_args(argv)
    a.batch_sizes = [int(x) for x in a.batch_sizes.split(",")]
    a.backends = [x.strip() for x in a.backends.split(",") if x.strip()]
    print(f"{'backend':<20} {'batch':>5} {'plain t/s':>10} {'json t/s':>10} {'cpu loss':>8} {'pairs':>12}", file=sys.stderr)  # fmt: skip
    result = _run(a)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
