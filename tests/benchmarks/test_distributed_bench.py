"""``llmhal bench distributed`` on a tiny model: every size and batch reported, the TP=2 rows with
the collectives rank 0 ran and the step fan-out's cost, a size the model cannot split into
reported with the reason."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_bench_distributed_reports_each_size(tiny_models, tmp_path, capsys):
    from llmhal.benchmarks.distributed import main

    folder, _ = tiny_models("llama")  # 4 heads: 3 ranks do not divide them
    out = tmp_path / "bench.json"
    argv = ["--model", folder, "--tp", "1,2,3", "--batch-sizes", "1,2", "--new-tokens", "4",
            "--repeat", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows = {(r["tp"], r["batch"]): r for r in result["rows"]}
    assert set(rows) == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert all(r["decode_tps"] > 0 for r in rows.values())
    assert rows[(1, 1)]["collective_calls_per_step"] == 0
    two = rows[(2, 1)]
    assert two["all_reduce_bytes_per_step"] > 0 and two["dispatch_bytes_per_step"] > 0
    assert [f["tp"] for f in result["not_run"]] == [3]
    assert "tp=3" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_distributed_compares_batches_in_flight(tiny_models, tmp_path):
    """``--pp 1,2``: PP=1, then PP=2 one batch at a time and with a batch per stage in flight, the
    latter showing batches that overlapped and a busy fraction per stage."""
    from llmhal.benchmarks.distributed import main

    folder, _ = tiny_models("llama")
    out = tmp_path / "bench.json"
    argv = ["--model", folder, "--tp", "1", "--pp", "1,2", "--batch-sizes", "4", "--new-tokens",
            "6", "--repeat", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = {(r["pp"], r["in_flight"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(1, 1), (2, 1), (2, 2)}
    assert rows[(2, 1)]["overlapped_batches"] == 0 < rows[(2, 2)]["overlapped_batches"]
    for key in ((2, 1), (2, 2)):
        busy = rows[key]["stage_busy"]
        assert len(busy) == 2 and all(0 < b <= 1.05 for b in busy), busy
