"""Engine output against HF transformers on the same tiny random weights (fp32).

Greedy tokens must be identical for a batch of prompts of different lengths, and the per-step
log-probabilities of the top tokens must agree within a stated tolerance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from llmhal import LLM, SamplingParams
from llmhal.testing.tiny_models import ARCHS

PROMPTS = [
    [5, 17, 42],
    [7, 100, 23, 9, 88, 64, 3, 250, 31],
    [300],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28],
]
NEW_TOKENS = 32
# fp32 end to end; differences come from summation order only.
LOGPROB_ATOL = 2e-4


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, output_scores=True,
            return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), -1)
    return tokens, logprobs


def run_parity(folder: str, hf_model, backend: str, **llm_kwargs) -> None:
    llm = LLM(folder, dtype="float32", attention_backend=backend, **llm_kwargs)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref_tokens, ref_lp = hf_greedy(hf_model, prompt, NEW_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt {prompt}: {got.token_ids} != {ref_tokens}"
        for step, entry in enumerate(got.logprobs):
            for tok, lp in entry.items():
                assert abs(lp.logprob - float(ref_lp[step, tok])) < LOGPROB_ATOL, (
                    step,
                    tok,
                    lp,
                    float(ref_lp[step, tok]),
                )
    return llm


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", ["cpu_attn", "flex_attention"])
def test_greedy_matches_transformers(tiny_models, arch, backend):
    folder, hf_model = tiny_models(arch)
    run_parity(folder, hf_model, backend)


def test_reference_backend_matches_transformers(tiny_models):
    folder, hf_model = tiny_models("llama")
    run_parity(folder, hf_model, "reference")


def test_preemption_keeps_outputs(tiny_models):
    """A KV cache too small for all four requests at once forces preemption; outputs are unchanged."""
    folder, hf_model = tiny_models("llama")
    # 2 layers x 2 kv heads x 16 dims x 2 (k,v) x 4 bytes x 16 tokens = 8 KiB per block; 6 blocks = 96
    # tokens, enough for the longest request (18 + 32 = 50 tokens, 4 blocks) but not for all four.
    llm = run_parity(folder, hf_model, "cpu_attn", kv_cache_memory_bytes=6 * 8192, block_size=16)
    assert llm.engine.stats.preemptions > 0


_TRITON_RUN = (
    "import json, sys\n"
    "from llmhal import LLM, SamplingParams\n"
    "llm = LLM(sys.argv[1], dtype='float32', attention_backend='triton_attn')\n"
    "params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)\n"
    "out = llm.generate([{'prompt_token_ids': json.loads(sys.argv[2])}], params)[0]\n"
    "print(json.dumps(out.outputs[0].token_ids))\n"
)


@pytest.mark.slow
def test_triton_interpreter_tiny_case(tiny_models):
    pytest.importorskip("triton")
    folder, hf_model = tiny_models("llama")
    # Triton reads TRITON_INTERPRET when it is imported, and an earlier test may have imported it
    # in this process: the engine runs in a fresh one.
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-c", _TRITON_RUN, str(folder), json.dumps(PROMPTS[0])]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    tokens = json.loads(res.stdout.strip().splitlines()[-1])
    assert tokens == hf_greedy(hf_model, PROMPTS[0], 4)[0]


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("backend", ["cpu_attn", "reference"])
def test_fp8_kv_cache_stays_close_to_the_model_dtype_cache(tiny_models, kv_dtype, backend):
    """An fp8 KV cache holds a quarter of the bytes and perturbs the distribution only slightly."""
    folder, _ = tiny_models("llama")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    exact = LLM(folder, dtype="float32", attention_backend=backend)
    fp8 = LLM(folder, dtype="float32", attention_backend=backend, kv_cache_dtype=kv_dtype)
    assert (
        fp8.engine.runner.kv_cache_bytes_per_block() * 4
        == exact.engine.runner.kv_cache_bytes_per_block()
    )
    for a, b in zip(exact.generate(prompts, params), fp8.generate(prompts, params), strict=True):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        top = max(first_a, key=lambda t: first_a[t].logprob)
        assert top == max(first_b, key=lambda t: first_b[t].logprob)
        # e4m3 keeps 3 mantissa bits, e5m2 only 2: a looser bound for the latter.
        tol = 0.15 if kv_dtype == "fp8_e4m3" else 0.5
        assert abs(first_a[top].logprob - first_b[top].logprob) < tol
