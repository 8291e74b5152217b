"""LFM2 (gated short convolutions + attention) through the engine against transformers on a tiny
random checkpoint (fp32): 64 greedy steps of a batch of prompts of different lengths, with prefill
chunked across steps and not, and across preemptions; its conv layers served by short_conv_attn."""

from __future__ import annotations

import json

import pytest

from llmhal import LLM
from llmhal.testing.engine_parity import (
    PROMPTS,
    compare_with_references,
    hf_references,
    preempting_budget,
)

STEPS = 64


@pytest.fixture(scope="module")
def lfm2(tiny_models):
    folder, hf = tiny_models("lfm2")
    return folder, hf_references(hf, PROMPTS, STEPS)


@pytest.fixture(scope="module")
def chunked_llm(lfm2):
    # 8 tokens a step: the 29-token prompt is prefilled in four chunks beside decoding requests.
    kw = dict(max_num_seqs=4, max_num_batched_tokens=8, enforce_eager=True)
    return LLM(lfm2[0], dtype="float32", **kw)


def test_matches_transformers_with_chunked_prefill(lfm2, chunked_llm):
    assert compare_with_references(chunked_llm, lfm2[1]) == []


def test_matches_transformers_unchunked_across_preemption(lfm2, chunked_llm):
    budget = preempting_budget(chunked_llm, slots=4, blocks=7)
    llm = LLM(lfm2[0], dtype="float32", max_num_seqs=4, kv_cache_memory_bytes=budget)
    assert compare_with_references(llm, lfm2[1]) == []
    assert llm.engine.stats.preemptions > 0


def test_conv_layers_use_short_conv_attn(chunked_llm):
    runner = chunked_llm.engine.runner
    assert {m.kind for m in runner.state_layers} == {"short_conv"}
    assert len(runner.state_layers) == 2 and len(runner.layers) == 1
    assert "short_conv_attn" in runner.attention_backends
    (spec,) = runner.state_layers[0].state_specs()
    assert spec.shape == (2, 64)  # kernel 3 -> the last 2 inputs of 64 channels


def test_generate_cli(lfm2, capsys):
    from llmhal.entrypoints import generate

    args = ["--model", lfm2[0], "--json", "--max-tokens", "5", "--no-chat", "--dtype", "float32",
            "--prompt", "Paris is"]  # fmt: skip
    assert generate.main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines[0]["token_ids"]) == 5


def test_serve_answers_like_the_offline_api(lfm2, chunked_llm):
    from llmhal import SamplingParams
    from llmhal.testing.http_client import post_json, running_server

    offline = chunked_llm.generate(["Paris is"], SamplingParams(temperature=0, max_tokens=6))[0]
    with running_server(chunked_llm) as (url, _):
        body = {"model": lfm2[0], "prompt": "Paris is", "max_tokens": 6, "temperature": 0}
        status, answer = post_json(f"{url}/v1/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == offline.outputs[0].text
