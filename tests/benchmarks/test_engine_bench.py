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


def _fake(decode: float, prefill: float, rss: float) -> dict:
    return {"decode": {"1": decode}, "prefill_tps": prefill, "peak_rss_mb": rss, "load_s": 1.0,
            "weight_bytes": 10, "attention": ["x"], "quantization": None}  # fmt: skip


def test_rounds_alternate_the_order_and_report_medians(tmp_path, capsys, monkeypatch):
    # Canned worker results: what is checked is the pairing, the order and the arithmetic.
    ours = iter([_fake(100, 50, 700), _fake(130, 40, 710), _fake(90, 60, 705)])
    theirs = iter([_fake(20, 50, 1000), _fake(25, 50, 1001), _fake(30, 40, 1002)])
    calls = []

    def run_worker(system, spec):
        calls.append(system)
        return next(ours if system == "llmhal" else theirs)

    monkeypatch.setattr(bench, "run_worker", run_worker)
    out = tmp_path / "r.json"
    args = ["--model", "m", "--batch-sizes", "1", "--rounds", "3", "--json", str(out)]
    assert bench.main(args) == 0
    assert calls == ["llmhal", "hf", "hf", "llmhal", "llmhal", "hf"]
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("decode"))
    # Medians 100 and 25; per-round ratios 5.0, 5.2, 3.0: median 5.00x, range 3.00-5.20x.
    assert line.split()[-4:] == ["100.0", "25.0", "5.00x", "3.00-5.20x"]
    result = json.loads(out.read_text())
    assert result["llmhal"]["decode"]["1"] == 100 and result["transformers"]["prefill_tps"] == 50
    assert len(result["rounds"]) == 3 and result["rounds"][1]["llmhal"]["decode"]["1"] == 130


def test_rounds_must_be_positive(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench.main(["--model", "m", "--rounds", "0"])
    assert "--rounds" in capsys.readouterr().err


def test_a_workers_peak_memory_is_its_own():
    """A worker started after its parent peaked reports its own peak, not the parent's (which
    ru_maxrss would carry into a process started through vfork)."""
    import subprocess
    import sys

    import numpy as np

    big = np.ones(600 << 20, dtype=np.uint8)  # the parent's peak: 600 MiB touched
    del big
    code = "from llmhal.benchmarks.engine import _peak_rss_mb; print(_peak_rss_mb())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=True).stdout)  # fmt: skip
    assert 0 < child < 400, child
