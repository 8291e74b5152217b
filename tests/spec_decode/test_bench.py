"""``llmhal bench spec`` runs every method beside plain decoding and checks the outputs agree."""

from __future__ import annotations

import json

from llmhal.benchmarks.spec import DEFAULT_METHODS, main


def test_bench_spec_reports_each_method(tiny_folder, tmp_path):
    out = tmp_path / "spec.json"
    # Every default method, the random EAGLE and Medusa heads made for the tiny target included.
    rc = main(["--model", tiny_folder, "--max-tokens", "6", "--repeat", "1", "--batch-sizes", "1,2", "--prompts", "1", "--json", str(out)])  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["workload"], r["batch"]) for r in rows} == {(w, b) for w in ("repetitive", "chat") for b in (1, 2)}  # fmt: skip
    assert {r["method"] for r in rows} == {"plain", *DEFAULT_METHODS}
    assert all(r["same_output"] and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["speedup"] == 1.0 for r in rows if r["method"] == "plain")
