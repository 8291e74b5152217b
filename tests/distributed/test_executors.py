"""Executors (issue 24): a model split over ranks by tensor (TP) and pipeline (PP) parallelism
gives the same greedy tokens as one process, through every executor backend.

The fast tier keeps one ``mp`` TP=2 run on the default model (SmolLM2-135M, Q4_1 GGUF) and one on
a tiny Llama; the rest (Qwen, quantized, PP, TP x PP, Ray, torchrun) are marked slow.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from llmhal import LLM, SamplingParams
from llmhal.testing.processes import process_gone

PROMPTS = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KV = 4 << 20


def greedy_ids(model: str | None, prompts=PROMPTS, params=GREEDY, **kwargs) -> list[list[int]]:
    """Each prompt's greedy tokens from an LLM built with ``kwargs``; its ranks stopped after."""
    llm = LLM(model, kv_cache_memory_bytes=KV, **kwargs)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_default_model_tp2_mp_equals_one_process():
    """The issue's headline: the default model on two gloo ranks answers as one process does."""
    ray_before = "ray" in sys.modules
    two = LLM(None, kv_cache_memory_bytes=KV, tensor_parallel_size=2, max_model_len=256)
    try:
        assert two.engine.config.parallel.distributed_executor_backend == "mp"  # the default
        assert two.engine.runner.decode_graphs is None  # no recorded steps across ranks
        got = [o.outputs[0].token_ids for o in two.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
        pids = two.engine.executor.worker_pids
        # The ranks' KV heads (2 + 1 of 3) add up to one model's keys and values per token.
        cfg, report = two.engine.config.model.hf_config, two.load_report
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        one_model = cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * report.dtype.itemsize  # fmt: skip
        assert report.kv_cache_bytes_per_token == one_model
    finally:
        two.shutdown()
    one = LLM(None, kv_cache_memory_bytes=KV, max_model_len=256)
    try:
        assert got == [o.outputs[0].token_ids for o in one.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]  # fmt: skip
        # Weights too are every rank's: the split layers add up to one model's, and what each
        # rank holds whole (the norms) counts twice, a fraction of a percent here.
        whole = one.load_report.weight_bytes
        assert whole < report.weight_bytes < whole * 1.01
    finally:
        one.shutdown()
    assert ray_before or "ray" not in sys.modules  # Ray is imported only when chosen
    for pid in pids:  # shutdown stops the worker
        assert process_gone(pid)


def test_tiny_llama_tp2_mp_equals_one_process(tiny_models):
    folder, _ = tiny_models("llama")
    assert greedy_ids(folder, tensor_parallel_size=2) == greedy_ids(folder)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
        ({"pipeline_parallel_size": "2"}, "pipeline_parallel_size must be a positive integer"),
        ({"distributed_executor_backend": "mpi"}, "Unknown distributed executor backend"),
        (
            {"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
            "use 'mp', 'ray' or 'external_launcher'",
        ),
    ],
)
def test_bad_parallel_settings_are_refused_before_loading(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM("/nonexistent/model", **kwargs)


def test_ray_is_imported_only_by_the_ray_backend():
    """Every other executor, the engine and the CLI's engine options leave Ray out (importing it
    is slow and has side effects; with amdsmi installed it even raises here)."""
    code = (
        "import sys\n"
        "import llmhal.engine.llm, llmhal.entrypoints.engine_args, llmhal.executor.worker\n"
        "from llmhal.executor import executor_class\n"
        "for name in ('uni', 'mp', 'external_launcher'):\n"
        "    executor_class(name)\n"
        "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))\n"
        "executor_class('ray')\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


# ------------------------------------------------------------------------------------ slow tier
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama_untied"])
def test_tiny_models_tp2_equal_one_process(tiny_models, arch):
    folder, _ = tiny_models(arch)
    assert greedy_ids(folder, tensor_parallel_size=2) == greedy_ids(folder)


@pytest.mark.slow
def test_fp8_checkpoint_tp2_equals_one_process(tmp_path):
    """An fp8 checkpoint (per-tensor weight scales, as fp8 checkpoints ship): every shard keeps
    its tensor's scale."""
    import torch

    from llmhal.testing.quant_models import PROMPTS as IDS
    from llmhal.testing.quant_models import write_pair

    def per_tensor(name, w):
        scale = (w.abs().amax() / 448.0).float()
        w8 = (w / scale).to(torch.float8_e4m3fn)
        return {"weight": w8, "weight_scale": scale.reshape(1)}, w8.float() * scale

    quant, _ = write_pair(tmp_path, per_tensor, {"quant_method": "fp8", "activation_scheme": "dynamic"})  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in IDS]
    want = greedy_ids(str(quant), prompts)
    assert greedy_ids(str(quant), prompts, tensor_parallel_size=2) == want


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
def test_deepseek_mla_tp_and_pp_equal_one_process(tmp_path, tp, pp):
    """DeepSeek-V3 through the engine's mp executor: two tensor-parallel ranks (MLA split by head,
    its latent cache whole on each rank; routed and shared experts split), two pipeline stages,
    and both.
    float32: in bf16 a rank's partial sums round apart from the whole sum, which on random weights
    flips near-tied greedy choices."""
    from llmhal.testing.model_parity import save_tiny_model, tiny_config
    from llmhal.testing.tiny_models import make_tokenizer
    from tests.distributed.test_sharded_models import DEEPSEEK_TP

    config = tiny_config(DEEPSEEK_TP[0], **DEEPSEEK_TP[1])
    save_tiny_model(config, tmp_path)
    make_tokenizer(config.vocab_size).save_pretrained(str(tmp_path))

    def run(**parallel):
        llm = LLM(str(tmp_path), kv_cache_memory_bytes=KV, dtype="float32", **parallel)
        try:
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            report = llm.load_report
            return [o.outputs[0].token_ids for o in outs], report
        finally:
            llm.shutdown()

    want, one = run()
    got, ranks = run(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert got == want
    # The report counts every rank's cache: stages add up to the model's latent cache, and each
    # tensor-parallel rank holds it whole.
    assert ranks.kv_cache_bytes_per_token == one.kv_cache_bytes_per_token * tp
    # And every rank's weights: stages hold disjoint layers (the embedding and LM head are not
    # tied here) plus a rotary table each (8 KiB), so they add up to one model's and a little;
    # tensor-parallel ranks add the tensors each holds whole (norms, the latent's kv_a
    # projection and norm, the router).
    assert one.weight_bytes < ranks.weight_bytes <= one.weight_bytes * tp + 8192 * pp


@pytest.mark.slow
def test_tiny_gguf_q8_tp2_equals_one_process(tmp_path, tiny_models):
    from llmhal.testing.gguf_files import write_tiny_gguf
    from llmhal.testing.tiny_models import TINY_VOCAB

    folder, _ = tiny_models("llama")  # its tokenizer (the GGUF file carries none)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", weight_type="Q8_0", vocab=TINY_VOCAB).path
    prompts = [{"prompt_token_ids": [5, 17, 42]}, {"prompt_token_ids": [7, 60, 23, 9]}]
    want = greedy_ids(str(path), prompts, tokenizer=folder)
    assert greedy_ids(str(path), prompts, tokenizer=folder, tensor_parallel_size=2) == want


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_tiny_llama_pipeline_equals_one_process(tiny_models, tp, pp):
    folder, _ = tiny_models("llama")
    want = greedy_ids(folder)
    got = greedy_ids(folder, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert got == want


@pytest.mark.slow
def test_default_model_pp2_equals_one_process():
    want = greedy_ids(None, PROMPTS[:2], max_model_len=256)
    assert greedy_ids(None, PROMPTS[:2], max_model_len=256, pipeline_parallel_size=2) == want


@pytest.mark.slow
def test_prompt_logprobs_and_sampling_agree_across_ranks(tiny_models):
    """Prompt log-probabilities (computed on the last stage) and seeded sampling come back to
    rank 0 the same as in one process."""
    folder, _ = tiny_models("llama")
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=6, prompt_logprobs=2)

    def run(**kw):
        llm = LLM(folder, kv_cache_memory_bytes=KV, **kw)
        try:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
        finally:
            llm.shutdown()
        lps = [
            [
                sorted((t, round(lp.logprob, 4)) for t, lp in e.items())
                for e in o.prompt_logprobs[1:]
            ]
            for o in outs
        ]
        return [o.outputs[0].token_ids for o in outs], lps

    assert run(pipeline_parallel_size=2) == run()


@pytest.mark.slow
def test_ray_tp2_equals_one_process(tiny_models):
    ray = pytest.importorskip("ray")
    folder, _ = tiny_models("llama")
    want = greedy_ids(folder)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        got = greedy_ids(folder, tensor_parallel_size=2, distributed_executor_backend="ray")
        got_pp = greedy_ids(folder, pipeline_parallel_size=2, distributed_executor_backend="ray")
    finally:
        ray.shutdown()
    assert got == want
    assert got_pp == want


_TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from llmhal import LLM, SamplingParams

    folder, tp, pp, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[5]
    llm = LLM(folder, kv_cache_memory_bytes=4 << 20, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, distributed_executor_backend="external_launcher")
    outs = llm.generate(json.loads(sys.argv[4]), SamplingParams(temperature=0, max_tokens=8,
                        ignore_eos=True), use_tqdm=False)
    # A file per rank: the ranks share torchrun's stdout, where their lines can interleave.
    with open(os.path.join(out, "rank" + os.environ["RANK"]), "w") as f:
        json.dump([o.outputs[0].token_ids for o in outs], f)
    llm.shutdown()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_external_launcher_under_torchrun_equals_one_process(tiny_models, tmp_path, tp, pp):
    """Every torchrun rank runs the engine and gets the same tokens as one process."""
    import json

    folder, _ = tiny_models("llama")
    script = tmp_path / "run.py"
    script.write_text(_TORCHRUN_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp * pp),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(script), folder, str(tp), str(pp), json.dumps(PROMPTS), str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    got = {f.name: json.loads(f.read_text()) for f in out.iterdir()}
    assert sorted(got) == [f"rank{r}" for r in range(tp * pp)]
    want = greedy_ids(folder)
    for rank, ids in got.items():
        assert ids == want, rank


def _free_port() -> int:
    from llmhal.distributed.launch import free_port

    return free_port()


@pytest.mark.slow
def test_generate_cli_takes_vllms_parallel_flags(tiny_models):
    """``llmhal generate -tp 2 --pipeline-parallel-size 1 --distributed-executor-backend mp``."""
    import json

    folder, _ = tiny_models("llama")
    cmd = [sys.executable, "-m", "llmhal.entrypoints.cli", "generate", "--model", folder,
           "-tp", "2", "--pipeline-parallel-size", "1", "--distributed-executor-backend", "mp",
           "--no-chat", "--max-tokens", "8", "--json", "--prompt", PROMPTS[0],
           "--kv-cache-memory-bytes", str(KV)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    first = json.loads(done.stdout.splitlines()[0])
    llm = LLM(folder, kv_cache_memory_bytes=KV)
    want = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8))
    assert first["text"] == want[0].outputs[0].text


def test_a_drafting_model_is_refused_with_more_than_one_rank(tiny_models):
    folder, _ = tiny_models("llama")
    spec = {"method": "draft_model", "model": folder, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="use 'ngram' or 'suffix'"):
        LLM(folder, tensor_parallel_size=2, speculative_config=spec)


def test_one_process_holds_one_multi_rank_engine_at_a_time(tiny_models):
    folder, _ = tiny_models("llama")
    two = LLM(folder, kv_cache_memory_bytes=KV, tensor_parallel_size=2)
    try:
        for kwargs in ({}, {"tensor_parallel_size": 2}):
            with pytest.raises(RuntimeError, match=r"call shutdown\(\) on"):
                LLM(folder, kv_cache_memory_bytes=KV, **kwargs)
        # The refused engines left the live one's process group alone.
        got = [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        two.shutdown()
    assert got == greedy_ids(folder)


@pytest.mark.slow
def test_ngram_speculation_tp2_equals_one_process(tiny_models):
    folder, _ = tiny_models("llama")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    prompts = ["1, 2, 3, 1, 2, 3, 1, 2, 3,"] + PROMPTS
    want = greedy_ids(folder, prompts)
    assert greedy_ids(folder, prompts, speculative_config=spec, tensor_parallel_size=2) == want


def test_a_script_that_never_calls_shutdown_exits_quietly(tiny_models, tmp_path):
    """The usual script: build, generate, fall off the end. Its workers stop at interpreter exit,
    and stopping them is not reported as a rank failing."""
    folder, _ = tiny_models("llama")
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(f"""
        from llmhal import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({folder!r}, kv_cache_memory_bytes={KV}, tensor_parallel_size=2)
            out = llm.generate(["hi"], SamplingParams(max_tokens=2, ignore_eos=True))
            print("pids", *llm.engine.executor.worker_pids)
        """)
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "ERROR" not in done.stderr, done.stderr
    pids = [int(p) for p in done.stdout.split("pids", 1)[1].split()]
    assert all(process_gone(pid) for pid in pids)
