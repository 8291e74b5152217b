"""`llmhal bench serve` against a tiny model's server: every request counted, the figures sane."""

from __future__ import annotations

import json

from llmhal import LLM
from llmhal.benchmarks import serve as bench
from llmhal.testing.http_client import running_server


def test_levels_measure_every_request(tiny_models, tmp_path, capsys):
    folder, _ = tiny_models("llama")
    with running_server(LLM(folder, dtype="float32", max_model_len=256)) as (base, _):
        out = tmp_path / "serve.json"
        code = bench.main(["--base-url", base, "--concurrency", "1,3", "--num-prompts", "3",
                           "--input-len", "8", "--output-len", "4", "--json", str(out)])  # fmt: skip
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["concurrency"], r["requests"], r["failed"]) for r in rows] == [(1, 3, 0), (3, 3, 0)]
    for r in rows:
        assert r["output_tok_s"] > 0 and 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
    assert "TTFT p99" in capsys.readouterr().out
