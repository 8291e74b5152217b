"""``llmhal bench moe --llama-cpp``: the GGUF file it writes for llama.cpp (read back by llmhal to
the checkpoint's tokens), the table's llama.cpp row, and (slow, with a llama.cpp build named by
``LLMHAL_LLAMA_BATCHED_BENCH``) a real llama.cpp run."""

from __future__ import annotations

import os
from argparse import Namespace

import pytest

from llmhal import LLM, SamplingParams
from llmhal.benchmarks import llama_cpp
from llmhal.benchmarks import moe as bench

gguf = pytest.importorskip("gguf")

SHAPE = bench.MoeShape(hidden=64, expert=32, layers=2, heads=4, kv_heads=2, head_dim=16)
PROMPTS = [[5, 9, 30, 7], [100, 3, 250, 12, 8]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return bench.make_checkpoints(tmp_path_factory.mktemp("bench_moe"), SHAPE)["moe"]


def _greedy(path, dtype: str) -> list[list[int]]:
    llm = LLM(str(path), dtype=dtype, kv_cache_memory_bytes=4 << 20)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))  # fmt: skip
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gguf_file_holds_the_checkpoint(checkpoint, tmp_path, dtype):
    path = llama_cpp.write_mixtral_gguf(checkpoint, tmp_path / "m.gguf", dtype)
    r = gguf.GGUFReader(str(path))
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["llama.expert_count"].contents() == SHAPE.experts
    assert r.fields["tokenizer.ggml.model"].contents() == "gpt2"
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.1.attn_norm.weight"] == "F32"
    matrix = "BF16" if dtype == "bfloat16" else "F32"
    assert types["blk.1.ffn_down_exps.weight"] == types["blk.0.attn_q.weight"] == matrix
    gate = next(t for t in r.tensors if t.name == "blk.0.ffn_gate_exps.weight")
    assert list(gate.shape) == [SHAPE.hidden, SHAPE.expert, SHAPE.experts]  # GGUF order
    # llmhal's GGUF loader undoes the layout (q/k row order, stacked experts, names): the file
    # decodes to the checkpoint's greedy tokens.
    assert _greedy(path, dtype) == _greedy(checkpoint, dtype)


def test_an_existing_file_is_kept_and_other_models_are_refused(checkpoint, tmp_path):
    kept = tmp_path / "kept.gguf"
    kept.write_bytes(b"x")
    assert llama_cpp.write_mixtral_gguf(checkpoint, kept, "float32").read_bytes() == b"x"
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match="MixtralForCausalLM"):
        llama_cpp.write_mixtral_gguf(other, tmp_path / "o.gguf", "float32")


def test_the_table_gets_a_llama_cpp_row(tmp_path, monkeypatch, capsys):
    from tests.benchmarks.test_moe_bench import TINY, _fake, _table

    seen = []

    def run_worker(system, model, a, dtype, quantization=None):
        seen.append((system, str(model)))
        return _fake(20, 40) if system == "llama.cpp" else _fake(50, 200)

    monkeypatch.setattr(bench, "run_worker", run_worker)
    argv = [*TINY, "--no-int8", "--no-dense", "--no-hf", "--llama-cpp", "/opt/llama-batched-bench"]
    assert bench.main([*argv, "--workdir", str(tmp_path), "--family", "mixtral,deepseek"]) == 0
    assert [s[0] for s in seen] == ["llmhal", "llama.cpp", "llmhal"]  # deepseek: no GGUF writer
    assert seen[1][1].endswith("-float32.gguf") and os.path.exists(seen[1][1])
    captured = capsys.readouterr()
    assert _table(captured.out)["llmhal / llama.cpp (MoE)"] == ["2.50x", "5.00x"]
    assert "deepseek: llama.cpp not run" in captured.err


def test_a_failing_llama_cpp_run_says_why(tmp_path):
    fake = tmp_path / "fails"
    fake.write_text("#!/bin/sh\necho 'error: no such model' >&2\nexit 3\n")
    fake.chmod(0o755)
    a = Namespace(batch_sizes=[1], prompt_len=4, new_tokens=2, repeat=1)
    with pytest.raises(RuntimeError, match="failed \\(3\\):\nerror: no such model"):
        llama_cpp.measure(str(fake), tmp_path / "fails", a)
    fake.write_text("#!/bin/sh\necho 'loaded, then nothing'\n")
    with pytest.raises(RuntimeError, match="printed no result 5 times"):
        llama_cpp.measure(str(fake), tmp_path / "fails", a)


@pytest.mark.slow
def test_llama_cpp_decodes_the_file(checkpoint, tmp_path, monkeypatch):
    binary = os.environ.get("LLMHAL_LLAMA_BATCHED_BENCH")
    if not binary:
        pytest.skip("set LLMHAL_LLAMA_BATCHED_BENCH to a llama.cpp llama-batched-bench binary")
    # One thread, as the bench's figures are taken: with a thread a core, llama.cpp's logging
    # thread may not run before a run of this tiny model ends (see llama_cpp._TRIES).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = llama_cpp.write_mixtral_gguf(checkpoint, tmp_path / "m.gguf", "bfloat16")
    a = Namespace(batch_sizes=[1, 2], prompt_len=8, new_tokens=256, repeat=1)
    got = llama_cpp.measure(binary, path, a)
    # llama.cpp's own clock of the decode steps (256 of them: this tiny model's step is tens of
    # microseconds): finite, and more tokens a second at batch 2
    assert 0 < got["decode"]["1"] < got["decode"]["2"] < 1e7, got
    assert got["decode_cpu"]["1"] > 0 and got["peak_rss_mb"] is None
