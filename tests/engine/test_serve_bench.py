"""`llmhal bench serve` against a tiny model's server: every request counted, the figures sane,
percentiles as vLLM computes them; without --base-url the server runs in a process of its own."""

from __future__ import annotations

import json

import pytest

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


def test_percentiles_are_numpys_as_vllm_reports_them():
    import numpy as np

    gaps = [0.011, 0.012, 0.010, 0.050, 0.013, 0.011, 0.090, 0.012, 0.014]
    for q in (50, 90, 99):
        assert bench._pct(gaps, q) == np.percentile(gaps, q)
    assert bench._pct([], 99) != bench._pct([], 99)  # nan: no gaps, nothing to report


def test_a_server_that_cannot_start_is_reported_with_its_own_words(capsys):
    # Without --base-url the bench starts `llmhal serve` apart; its refusal reaches the user.
    assert bench.main(["--max-num-seqs", "0x"]) == 2
    err = capsys.readouterr().err
    assert "llmhal bench serve: the server" in err and "exited with status 2" in err
    assert "--max-num-seqs" in err  # argparse's own message, from the server's stderr


@pytest.mark.slow
def test_without_a_base_url_the_model_is_served_apart_for_the_run(tiny_models, tmp_path):
    folder, _ = tiny_models("llama")
    out = tmp_path / "serve.json"
    code = bench.main(["--concurrency", "2", "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
                       "--json", str(out), "--model", folder, "--dtype", "float32", "--max-model-len", "256"])  # fmt: skip
    assert code == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["requests"], row["failed"]) == (2, 0)
    assert row["load_before"] is None or row["load_before"] >= 0
