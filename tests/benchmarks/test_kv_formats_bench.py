"""``llmhal bench kv_formats`` on the tiny model: one row per format, sizes from the load report."""

from __future__ import annotations

import json

from llmhal.benchmarks import kv_formats


def test_each_format_gets_its_row_with_its_bytes_per_token(tiny_models, tmp_path, capsys):
    folder, _ = tiny_models("llama")
    out = tmp_path / "kv.json"
    argv = ["--model", folder, "--formats", "int8,nvfp4", "--batch-sizes", "1,2", "--prompt-len",
            "8", "--new-tokens", "3", "--repeat", "1", "--kv-budget-mib", "1", "--json", str(out)]  # fmt: skip
    assert kv_formats.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| auto", "| int8", "| nvfp4"]
    runs = json.loads(out.read_text())["runs"]
    # The tiny Llama (fp32): 2 layers x 2 KV heads x 16 values, K and V.
    sizes = {f: r[0]["bytes_per_token"] for f, r in runs.items()}
    assert sizes == {"auto": 512, "int8": 160, "nvfp4": 72}
    # A fixed budget holds more tokens the smaller the rows (whole blocks of 16).
    held = [runs[f][0]["tokens_in_budget"] for f in ("auto", "int8", "nvfp4")]
    assert held == [(1 << 20) // (s * 16) * 16 for s in (512, 160, 72)]
    assert all(v > 0 for r in runs.values() for v in r[0]["decode_tps"].values())
