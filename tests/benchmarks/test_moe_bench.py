"""``llmhal bench moe``: the checkpoints it builds, the table's arithmetic, and (slow) a real run."""

from __future__ import annotations

import json

import pytest

from llmhal.benchmarks import moe as bench

TINY = ["--hidden", "64", "--expert", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "16", "--new-tokens", "4", "--repeat", "1"]  # fmt: skip
TINY_DEEPSEEK = ["--deepseek-hidden", "64", "--deepseek-expert", "16", "--deepseek-layers", "2",
                 "--deepseek-heads", "2", "--deepseek-kv-lora-rank", "32",
                 "--deepseek-qk-nope", "16", "--deepseek-qk-rope", "8", "--deepseek-v-head", "16",
                 "--new-tokens", "4", "--repeat", "1"]  # fmt: skip


def _fake(b1: float, b8: float, weights: int = 4 << 20) -> dict:
    rates = {"1": b1, "8": b8}
    wall = {"1": b1 / 2, "8": b8 / 2}
    return {"decode_cpu": rates, "decode": wall, "weight_bytes": weights, "peak_rss_mb": 500.0}


def _table(out: str) -> dict[str, list[str]]:
    """The CPU-time block's rows (the first of each name) by label."""
    rows: dict[str, list[str]] = {}
    for line in out.splitlines():
        rows.setdefault(line[:34].strip(), line[34:].split())
    return rows


def test_checkpoints_and_table(tmp_path, monkeypatch, capsys):
    canned = {"moe": _fake(50, 200), "hf_moe": _fake(25, 50), "dense": _fake(60, 400),
              "int8": _fake(40, 160, 1 << 20)}  # fmt: skip
    order = iter(canned)
    seen = []

    def run_worker(system, model, a, dtype, quantization=None):
        seen.append((system, str(model), quantization, dtype))
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
    assert seen[3][2] == "experts_int8" and {s[3] for s in seen} == {"float32"}
    lines = _table(capsys.readouterr().out)
    assert lines["llmhal / transformers (MoE)"] == ["2.00x", "4.00x"]
    assert lines["MoE / dense time per token"] == ["1.20x", "2.00x"]
    assert lines["experts_int8 / unquantized speed"] == ["0.80x", "0.80x"]
    assert lines["llmhal MoE experts_int8"] == ["40.00", "160"]  # CPU time, not wall
    saved = json.loads(out.read_text())
    assert saved["results"]["mixtral float32"]["moe"]["decode_cpu"]["8"] == 200


def test_deepseek_checkpoints_dtypes_and_kv_bytes(tmp_path, monkeypatch, capsys):
    seen = []

    def run_worker(system, model, a, dtype, quantization=None):
        seen.append((system, str(model), dtype))
        return _fake(10, 40)

    monkeypatch.setattr(bench, "run_worker", run_worker)
    argv = [*TINY_DEEPSEEK, "--family", "deepseek", "--dtype", "float32,bfloat16", "--no-int8"]
    assert bench.main([*argv, "--workdir", str(tmp_path)]) == 0
    assert [(s[0], s[2]) for s in seen] == [
        ("llmhal", "float32"), ("hf", "float32"), ("llmhal", "float32"),
        ("llmhal", "bfloat16"), ("hf", "bfloat16"), ("llmhal", "bfloat16"),
    ]  # fmt: skip
    moe = json.loads((tmp_path / seen[0][1].split("/")[-1] / "config.json").read_text())
    dense = json.loads((tmp_path / seen[2][1].split("/")[-1] / "config.json").read_text())
    assert moe["architectures"] == ["DeepseekV2ForCausalLM"] and moe["first_k_dense_replace"] == 1
    # every layer dense, as wide as the chosen (4) and shared (2) experts together
    assert dense["first_k_dense_replace"] == 2 and dense["intermediate_size"] == 6 * 16
    out = capsys.readouterr().out
    # (32 + 8) latent values a layer against 2 heads x (16 + 8 + 16), two layers, 4 then 2 bytes
    assert " 320 " in out and " 640 " in out and " 160 " in out and "2.00x" in out


def test_unknown_family_or_dtype_names_the_choices():
    with pytest.raises(SystemExit, match="mixtral, deepseek"):
        bench.main(["--family", "llama"])
    with pytest.raises(SystemExit, match="float32, bfloat16"):
        bench.main(["--dtype", "fp8"])


@pytest.mark.slow
def test_real_run_on_a_tiny_shape(capsys):
    assert bench.main([*TINY, *TINY_DEEPSEEK, "--family", "mixtral,deepseek"]) == 0
    table = capsys.readouterr().out
    assert "llmhal / transformers (MoE)" in table and "experts_int8" in table
    assert "KV bytes/token" in table
