"""``llmhal bench moe``: the checkpoints it builds, the table's arithmetic, and (slow) a real run."""

from __future__ import annotations

import json

import pytest

from llmhal.benchmarks import moe as bench

TINY = ["--hidden", "64", "--expert", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "16", "--new-tokens", "4", "--repeat", "1", "--prefill-len", "16"]  # fmt: skip


def _fake(b1: float, b8: float, weights: int = 4 << 20) -> dict:
    return {"decode": {"1": b1, "8": b8}, "weight_bytes": weights, "peak_rss_mb": 500.0}


def test_checkpoints_and_table(tmp_path, monkeypatch, capsys):
    canned = {"moe": _fake(50, 200), "hf_moe": _fake(25, 50), "dense": _fake(60, 400),
              "int8": _fake(40, 160, 1 << 20)}  # fmt: skip
    order = iter(canned)
    seen = []

    def run_worker(system, spec):
        seen.append((system, spec.model, spec.quantization))
        return canned[next(order)]

    monkeypatch.setattr(bench, "run_worker", run_worker)
    out = tmp_path / "r.json"
    assert bench.main([*TINY, "--workdir", str(tmp_path), "--json", str(out)]) == 0
    moe, dense = seen[0][1], seen[2][1]
    cfg = json.loads((tmp_path / moe.split("/")[-1] / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["num_local_experts"] == 8
    dense_cfg = json.loads((tmp_path / dense.split("/")[-1] / "config.json").read_text())
    assert dense_cfg["intermediate_size"] == 2 * cfg["intermediate_size"]  # top-2 active
    assert [s[0] for s in seen] == ["llmhal", "hf", "llmhal", "llmhal"]
    assert seen[3][2] == "experts_int8"
    lines = {line[:34].strip(): line[34:].split() for line in capsys.readouterr().out.splitlines()}
    assert lines["llmhal / transformers (MoE)"] == ["2.00x", "4.00x"]
    assert lines["MoE / dense time per token"] == ["1.20x", "2.00x"]
    assert lines["experts_int8 / unquantized speed"] == ["0.80x", "0.80x"]
    assert lines["llmhal MoE experts_int8"][-2:] == ["1.00", "500"]
    assert json.loads(out.read_text())["results"]["moe"]["decode"]["8"] == 200


@pytest.mark.slow
def test_real_run_on_a_tiny_shape(capsys):
    assert bench.main(TINY) == 0
    table = capsys.readouterr().out
    assert "llmhal / transformers (MoE)" in table and "experts_int8" in table
