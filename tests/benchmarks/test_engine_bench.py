"""The engine benchmark end to end on a tiny model: both workers run and the table has ratios."""

from __future__ import annotations

import json

from llmhal.benchmarks import engine as bench


def test_engine_bench_runs_llmhal_and_transformers(tmp_path, capsys):
    from llmhal.testing.tiny_models import make_tiny_model

    make_tiny_model(tmp_path / "m", "llama")
    out = tmp_path / "r.json"
    args = ["--model", str(tmp_path / "m"), "--batch-sizes", "1,2", "--new-tokens", "4",
            "--prompt-len", "8", "--prefill-len", "16", "--json", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    table = capsys.readouterr().out
    assert "decode tok/s, batch 2" in table and "x" in table.split("batch 2")[1].splitlines()[0]
    result = json.loads(out.read_text())
    for system in ("llmhal", "transformers"):
        assert result[system]["decode"]["1"] > 0 and result[system]["prefill_tps"] > 0
    assert result["llmhal"]["weight_bytes"] > 0
