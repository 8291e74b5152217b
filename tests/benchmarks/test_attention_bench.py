"""``llmhal bench attention`` on a tiny configuration: every backend row is measured or says why not,
and the measured outputs agree with SDPA."""

from __future__ import annotations

import json

from llmhal.benchmarks import attention


def test_tiny_run_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "attention.json"
    argv = [
        "--backends", "cpu_attn,reference,no_such_backend",
        "--dtypes", "float32",
        "--batch", "1,3",
        "--context", "40",
        "--num-heads", "4", "--num-kv-heads", "2", "--head-size", "16",
        "--repeats", "1", "--warmup", "1", "--flush-mb", "1",
        "--max-prefill-tokens", "64",
        "--json", str(out),
    ]  # fmt: skip
    assert attention.main(argv) == 0
    table = capsys.readouterr().out
    assert "sdpa ms" in table and "threads" in table
    data = json.loads(out.read_text())
    assert data["machine"]["torch_threads"] >= 1
    rows = {(r["mode"], r["batch"], r["backend"]): r for r in data["rows"]}
    assert len(rows) == 2 * 2 * 3
    for mode in ("decode", "prefill"):
        missing = rows[(mode, 1, "no_such_backend")]
        assert missing["ms"] is None and "not registered" in missing["note"]
    # batch 3 x context 40 = 120 prefill tokens > 64: skipped, and says so
    assert "skipped" in rows[("prefill", 3, "cpu_attn")]["note"]
    for key in [("decode", 1), ("decode", 3), ("prefill", 1)]:
        for backend in ("cpu_attn", "reference"):
            r = rows[(*key, backend)]
            if r["ms"] is None:  # only when the backend cannot run on this platform at all
                assert r["note"].startswith("unavailable"), r
                continue
            assert r["ms"] > 0 and r["sdpa_ms"] > 0 and r["ratio"] > 0
            assert r["max_abs_diff"] < 1e-4, r
