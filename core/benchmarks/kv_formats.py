"""``llmhal bench kv_formats``: each KV-cache format's size and decode speed on one model, in one run.

For every ``--formats`` entry (``auto`` first: the baseline) the model is loaded with that
``kv_cache_dtype`` and measured the same way: KV bytes per token (the load report, which equals
:func:`llmhal.attention.kv_formats.kv_bytes_per_token`), the tokens a fixed KV budget holds, and
decode tokens/s at each batch size after a ``--prompt-len``-token prompt (the best of ``--repeat``
runs; interference only ever slows a run). ``--rounds N`` measures every format N times,
alternating the order, and reports each format's range, so a drift of the shared host shows as a
range instead of a ratio. Prefix caching is off (the runs repeat their prompts).
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any


def _measure(a: argparse.Namespace, fmt: str) -> dict[str, Any]:
    from llmhal import LLM, SamplingParams

    llm = LLM(
        a.model, kv_cache_dtype=fmt, max_num_seqs=max(a.batch_sizes), enable_prefix_caching=False,
        kv_cache_memory_bytes=a.kv_budget_mib << 20,
    )  # fmt: skip
    report = llm.load_report
    vocab = llm.engine.config.model.hf_config.vocab_size
    rng = random.Random(0)
    stats = llm.engine.stats

    def run(batch: int) -> float:
        prompts = [
            [rng.randrange(10, vocab - 10) for _ in range(a.prompt_len)] for _ in range(batch)
        ]
        stats.__init__()
        params = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return stats.decode_tps

    run(max(a.batch_sizes))  # untimed: first-use costs
    decode = {b: max(run(b) for _ in range(a.repeat)) for b in a.batch_sizes}
    return {
        "bytes_per_token": report.kv_cache_bytes_per_token,
        "tokens_in_budget": report.num_blocks * llm.engine.config.cache.block_size,
        "attention": report.attention_backends,
        "dtype": str(report.dtype).removeprefix("torch."),
        "decode_tps": decode,
    }


def main(argv: list[str] | None = None) -> int:
    from llmhal.default_model import default_model_path

    p = argparse.ArgumentParser(prog="llmhal bench kv_formats", description=__doc__)
    p.add_argument(
        "--model", default=None, help="a .gguf file or a folder (default: the default model)"
    )
    p.add_argument("--formats", default="auto,fp8_e4m3,int8,nvfp4")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument(
        "--kv-budget-mib", type=int, default=64, help="the KV cache budget each format gets"
    )
    p.add_argument("--json", dest="json_path", help="also write the results here")
    a = p.parse_args(argv)
    a.model = a.model or default_model_path()
    a.batch_sizes = [int(x) for x in a.batch_sizes.split(",")]
    formats = ["auto", *[f for f in a.formats.split(",") if f != "auto"]]
    runs: dict[str, list[dict[str, Any]]] = {f: [] for f in formats}
    for r in range(a.rounds):
        for fmt in formats if r % 2 == 0 else formats[::-1]:
            runs[fmt].append(_measure(a, fmt))
    base = runs["auto"][0]
    print(
        f"{a.model}: {base['dtype']}, prompt {a.prompt_len} tokens, {a.new_tokens} decoded, {a.rounds} round(s)"
    )
    head = f"| kv_cache_dtype | B/token | tokens in {a.kv_budget_mib} MiB | "
    head += " | ".join(f"decode tok/s, batch {b}" for b in a.batch_sizes) + " | backend |"
    print(head)
    print("|" + "---|" * (4 + len(a.batch_sizes)))
    for fmt, rs in runs.items():
        cells = []
        for b in a.batch_sizes:
            vals = [x["decode_tps"][b] for x in rs]
            cells.append(f"{min(vals):.1f}" + (f"-{max(vals):.1f}" if len(vals) > 1 else ""))
        print(
            f"| {fmt} | {rs[0]['bytes_per_token']} | {rs[0]['tokens_in_budget']} | "
            + " | ".join(cells)
            + f" | {','.join(rs[0]['attention'])} |"
        )
    if a.json_path:
        with open(a.json_path, "w") as fh:
            json.dump({"model": a.model, "runs": runs}, fh, indent=2)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
