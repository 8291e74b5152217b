"""`llmhal doctor`'s KV-cache rows: the default (or LLMHAL_MODEL's) model's bytes per token in the
chosen ``--kv-cache-dtype`` and in every format, equal to the formula and to what ``LLM`` allocates,
for a GQA model (the installed default) and an MLA one (DeepSeek's latent cache)."""

from __future__ import annotations

import json

import pytest
import torch

from llmhal import doctor
from llmhal.attention.backend import KV_CACHE_DTYPES
from llmhal.attention.kv_formats import row_bytes
from llmhal.testing.kv_accuracy import save_tiny_mla


def test_the_default_models_bytes_per_token_in_each_format(capsys, monkeypatch):
    monkeypatch.delenv("LLMHAL_MODEL", raising=False)
    assert doctor.main(["--json", "--kv-cache-dtype", "nvfp4"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv_cache"]
    assert kv["model"].endswith(".gguf") and kv["backend"] == "cpu_attn"
    dtype = getattr(torch, kv["dtype"])  # the engine's auto dtype here: bf16 or float32
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 values, a key and a value row each.
    rows = {r["kv_cache_dtype"]: r for r in kv["formats"]}
    assert list(rows) == list(KV_CACHE_DTYPES)
    for name, row in rows.items():
        assert row["bytes_per_token"] == 2 * 30 * 3 * row_bytes(name, 64, dtype), name
        assert row["served"] and not row["reasons"]
    assert (kv["kv_cache_dtype"], kv["bytes_per_token"]) == ("nvfp4", 2 * 30 * 3 * 36)
    assert kv["formula"] == "2 (K, V) x 30 layers x 3 KV heads x a row of 64 values (nvfp4: 36 B)"


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return save_tiny_mla(tmp_path_factory.mktemp("deepseek_doctor"))[0]


@pytest.mark.parametrize("name", ["auto", "int8"])
def test_an_mla_model_gets_its_latent_row_and_llm_allocates_what_doctor_says(
    deepseek, monkeypatch, name
):
    from llmhal import LLM

    monkeypatch.setenv("LLMHAL_MODEL", deepseek)
    report = doctor.collect(name)
    kv = report["kv_cache"]
    assert kv["backend"] == "cpu_mla" and kv["kv_cache_dtype"] == name  # the CPU's own
    # (kv_lora_rank 32 + qk_rope_head_dim 16) x 3 layers: fp32 4 B a value, int8 48 + 4 B a row.
    assert kv["bytes_per_token"] == 3 * (48 * 4 if name == "auto" else 52)
    assert kv["formula"].startswith("3 layers x 1 latent row of 32 + 16 values")
    llm = LLM(deepseek, dtype="float32", kv_cache_dtype=name, kv_cache_memory_bytes=1 << 20)
    assert llm.load_report.kv_cache_bytes_per_token == kv["bytes_per_token"]
    assert llm.load_report.kv_cache_dtype == name
    text = doctor.format_report(report)
    assert f"{kv['bytes_per_token']} bytes per token = 3 layers x 1 latent row" in text
