"""``llmhal bench ssm``: the checkpoints it builds, the table's arithmetic, and (slow) a real run."""

from __future__ import annotations

import json

import pytest

from llmhal.benchmarks import ssm as bench

TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--head-dim", "32", "--state", "16",
        "--chunk", "16", "--attn-every", "2", "--attn-heads", "2", "--attn-kv-heads", "1",
        "--mlp", "64", "--contexts", "32,64", "--new-tokens", "8", "--repeat", "1"]  # fmt: skip


def _rates(cpu: tuple[float, float], wall: tuple[float, float]) -> dict:
    return {"decode_cpu": {"1": cpu[0], "8": cpu[1]}, "decode": {"1": wall[0], "8": wall[1]}}


def test_checkpoints_and_table(tmp_path, monkeypatch, capsys):
    canned = {
        "mamba2": {**_rates((30, 200), (20, 150)),
                   "context": {"32": 4.0, "64": 4.4, "cpu_32": 2.0, "cpu_64": 2.1}},
        "hf_mamba2": _rates((10, 50), (10, 50)),
        "hybrid": {**_rates((20, 100), (20, 100)), "context": {"32": 5.0, "64": 7.5}},
        "hf_hybrid": _rates((10, 20), (10, 20)),
    }  # fmt: skip
    seen = []

    def run_system(system, model, a, contexts=""):
        seen.append((system, str(model), contexts))
        arch = json.loads((model / "config.json").read_text())["architectures"][0]
        name = "mamba2" if arch == "Mamba2ForCausalLM" else "hybrid"
        return canned[name if system == "llmhal" else f"hf_{name}"]

    monkeypatch.setattr(bench, "run_system", run_system)
    out = tmp_path / "r.json"
    assert bench.main([*TINY, "--workdir", str(tmp_path), "--json", str(out)]) == 0
    assert [(s[0], s[2]) for s in seen] == [("llmhal", "32,64"), ("hf", "")] * 2
    mamba2 = json.loads((tmp_path / seen[0][1].split("/")[-1] / "config.json").read_text())
    assert (mamba2["num_heads"], mamba2["head_dim"], mamba2["expand"]) == (4, 32, 2)
    hybrid = json.loads((tmp_path / seen[2][1].split("/")[-1] / "config.json").read_text())
    assert hybrid["architectures"] == ["BambaForCausalLM"] and hybrid["attn_layer_indices"] == [1]
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    ratios = [r[-2:] for r in rows if r[:1] == ["llmhal"] and r[1:2] == ["/"]]
    # CPU time first (mamba2, hybrid), then wall time
    assert ratios == [
        ["3.00x", "4.00x"],
        ["2.00x", "5.00x"],
        ["2.00x", "3.00x"],
        ["2.00x", "5.00x"],
    ]
    ctx = {" ".join(r[:2]): r[2:] for r in rows if r[:1] in (["mamba2"], ["hybrid"])}
    assert ctx == {"mamba2 (CPU)": ["2.00", "2.10", "1.05x"], "mamba2 (wall)": ["4.00", "4.40", "1.10x"],
                   "hybrid (wall)": ["5.00", "7.50", "1.50x"]}  # fmt: skip
    assert json.loads(out.read_text())["results"]["hybrid"]["context"]["64"] == 7.5


def test_refuses_an_inner_width_that_is_not_a_multiple_of_hidden(tmp_path):
    with pytest.raises(SystemExit, match="multiple of hidden"):
        bench.main([*TINY[:4], "--heads", "3", *TINY[6:], "--workdir", str(tmp_path)])


@pytest.mark.slow
def test_real_run_on_a_tiny_shape(capsys):
    assert bench.main(TINY) == 0
    table = capsys.readouterr().out
    assert "llmhal / transformers" in table and "last/first" in table and "(CPU)" in table
