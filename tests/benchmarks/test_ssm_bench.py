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

    def run_system(system, model, a, contexts="", dtype="float32", ssm_state="auto"):
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
    assert json.loads(out.read_text())["results"]["float32"]["hybrid"]["context"]["64"] == 7.5


def test_both_dtypes_in_one_run(tmp_path, monkeypatch, capsys):
    """--dtype float32,bfloat16 loads both systems in each dtype in turn; the context rows are
    measured once, in bfloat16."""
    seen = []

    def run_system(system, model, a, contexts="", dtype="float32", ssm_state="auto"):
        seen.append((dtype, system, model.name.split("-")[0], contexts))
        scale = 2.0 if dtype == "bfloat16" else 1.0
        rates = _rates((10 * scale, 40 * scale), (10 * scale, 40 * scale))
        return {**rates, "context": {"32": 3.0, "64": 3.3}} if contexts else rates

    monkeypatch.setattr(bench, "run_system", run_system)
    out = tmp_path / "r.json"
    args = [*TINY, "--no-hybrid", "--workdir", str(tmp_path), "--json", str(out)]
    assert bench.main([*args, "--dtype", "float32,bfloat16"]) == 0
    assert seen == [
        ("float32", "llmhal", "mamba2", ""),
        ("float32", "hf", "mamba2", ""),
        ("bfloat16", "llmhal", "mamba2", "32,64"),
        ("bfloat16", "hf", "mamba2", ""),
    ]
    table = capsys.readouterr().out
    assert (
        "decode tok/s float32 (CPU time)" in table and "decode tok/s bfloat16 (wall time)" in table
    )
    assert "ms/token bfloat16" in table and "ms/token float32" not in table
    saved = json.loads(out.read_text())["results"]
    assert saved["bfloat16"]["mamba2"]["decode_cpu"]["8"] == 80.0
    assert saved["float32"]["hf_mamba2"]["decode"]["1"] == 10.0
    with pytest.raises(SystemExit, match="float32,bfloat16"):
        bench.main([*args, "--dtype", "float16"])


def test_workers_run_in_bfloat16(tmp_path):
    """Both workers load the tiny Mamba-2 in bfloat16 and decode (in-process: the subprocess
    plumbing is the same for every dtype)."""
    import argparse

    shape = bench.SsmShape(hidden=64, layers=2, heads=4, head_dim=32, state=16, chunk=16,
                           attn_every=2, attn_heads=2, attn_kv_heads=1, mlp=64)  # fmt: skip
    model = bench.make_checkpoints(tmp_path, shape, ["mamba2"])["mamba2"]
    a = argparse.Namespace(model=str(model), dtype="bfloat16", batch_sizes=[1, 2], prompt_len=8,
                           new_tokens=4, repeat=1, contexts="16",
                           mamba_ssm_cache_dtype="auto")  # fmt: skip
    for worker in (bench._hf_worker, bench._llmhal_worker):
        res = worker(a)
        assert res["dtype"] == "bfloat16"
        assert all(res[k][b] > 0 for k in ("decode", "decode_cpu") for b in ("1", "2")), res
    assert res["context"]["16"] > 0 and res["context"]["cpu_16"] > 0
    assert res["ssm_state"] == "bfloat16"  # vLLM's default: the model's dtype


def test_ssm_state_dtypes_share_one_baseline(tmp_path, monkeypatch, capsys):
    """--mamba-ssm-cache-dtype auto,float32: one llmhal worker per state dtype (the first measures
    the context rows), one transformers baseline, a ratio row for each."""
    seen = []

    def run_system(system, model, a, contexts="", dtype="float32", ssm_state="auto"):
        seen.append((system, contexts, ssm_state))
        return _rates((20, 80), (20, 80)) if ssm_state == "auto" else _rates((10, 40), (10, 40))

    monkeypatch.setattr(bench, "run_system", run_system)
    args = [
        *TINY,
        "--no-hybrid",
        "--no-contexts",
        "--workdir",
        str(tmp_path),
        "--dtype",
        "bfloat16",
    ]
    assert bench.main([*args, "--mamba-ssm-cache-dtype", "auto,float32"]) == 0
    assert seen == [("llmhal", "", "auto"), ("llmhal", "", "float32"), ("hf", "", "auto")]
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["llmhal", "mamba2", "ssm=float32", "10.00", "40.00"] in rows
    ratios = [r[-2:] for r in rows if r[1:2] == ["/"]]
    assert ratios[:2] == [["1.00x", "1.00x"], ["0.50x", "0.50x"]]  # CPU time: auto, float32
    with pytest.raises(SystemExit, match="auto, float32, bfloat16"):
        bench.main([*args, "--mamba-ssm-cache-dtype", "float16"])


def test_refuses_an_inner_width_that_is_not_a_multiple_of_hidden(tmp_path):
    with pytest.raises(SystemExit, match="multiple of hidden"):
        bench.main([*TINY[:4], "--heads", "3", *TINY[6:], "--workdir", str(tmp_path)])


@pytest.mark.slow
def test_real_run_on_a_tiny_shape(capsys):
    assert bench.main([*TINY, "--dtype", "float32,bfloat16"]) == 0
    table = capsys.readouterr().out
    assert "llmhal / transformers" in table and "last/first" in table and "(CPU)" in table
    assert "decode tok/s bfloat16 (CPU time)" in table and "ms/token bfloat16" in table
