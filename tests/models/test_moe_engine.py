"""MoE models through the engine (``LLM``): greedy tokens and log-probabilities equal to HF
transformers for a batch of prompts of different lengths, with a KV cache small enough to force
preemption (a MoE model is an ordinary decoder model to the scheduler and runner)."""

from __future__ import annotations

import pytest
import torch

from llmhal import LLM, SamplingParams
from llmhal.testing.model_parity import save_tiny_model, tiny_config
from llmhal.testing.tiny_models import make_tokenizer

PROMPTS = [[5, 17, 42], [7, 100, 23, 9, 88, 64, 3, 250, 31], [300], list(range(11, 29))]
NEW_TOKENS = 32
LOGPROB_ATOL = 2e-4  # fp32 end to end: summation order only
CASES = {
    "MixtralForCausalLM": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "Qwen3MoeForCausalLM": {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                            "head_dim": 16},
}  # fmt: skip


def _hf_greedy(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
            do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
            eos_token_id=None,
        )  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), torch.log_softmax(
        torch.stack(out.scores)[:, 0].float(), -1
    )


@pytest.mark.parametrize("arch", list(CASES))
def test_engine_matches_transformers_across_preemption(arch, tmp_path):
    cfg = tiny_config(arch, vocab_size=384, initializer_range=0.1, **CASES[arch])
    hf = save_tiny_model(cfg, tmp_path)
    make_tokenizer(cfg.vocab_size).save_pretrained(str(tmp_path))
    # 3 layers x 2 kv heads x 16 dims x 2 (k, v) x 4 bytes x 16 tokens = 12 KiB a block; 6 blocks
    # hold the longest request (18 + 32 tokens) but not all four at once.
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block = cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * 4 * 16
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes=6 * block, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert llm.engine.stats.preemptions > 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens, logprobs = _hf_greedy(hf, prompt)
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt {prompt}: {got.token_ids} != {tokens}"
        for step, entry in enumerate(got.logprobs):
            for tok, lp in entry.items():
                assert abs(lp.logprob - float(logprobs[step, tok])) < LOGPROB_ATOL, (step, tok)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3moe")
    cfg = tiny_config("Qwen3MoeForCausalLM", vocab_size=384, **CASES["Qwen3MoeForCausalLM"])
    save_tiny_model(cfg, folder)
    make_tokenizer(cfg.vocab_size).save_pretrained(str(folder))
    return folder


def test_generate_cli_with_experts_int8(qwen3_moe, capsys):
    import json

    from llmhal.entrypoints import generate

    args = ["--model", str(qwen3_moe), "--json", "--max-tokens", "5", "--no-chat",
            "--dtype", "float32", "--quantization", "experts_int8", "--prompt", "Paris is"]  # fmt: skip
    assert generate.main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines[0]["token_ids"]) == 5
    assert lines[1]["summary"]["quantization"] == "experts_int8"


def test_serve_answers_a_completion_like_the_offline_api(qwen3_moe):
    from llmhal.testing.http_client import post_json, running_server

    llm = LLM(str(qwen3_moe), dtype="float32", kv_cache_memory_bytes=1 << 20)
    offline = llm.generate(["Paris is"], SamplingParams(temperature=0, max_tokens=6))[0]
    with running_server(llm) as (url, _):
        body = {"model": str(qwen3_moe), "prompt": "Paris is", "max_tokens": 6, "temperature": 0}
        status, answer = post_json(f"{url}/v1/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == offline.outputs[0].text


# Shared experts (Qwen2-MoE's gated one; DeepSeek's, with its float32 router, grouped sigmoid
# routing and MLA) go into the same native MoE call on the CPU.
RECORDED = {
    **CASES,
    "Qwen2MoeForCausalLM": {**CASES["Qwen3MoeForCausalLM"], "shared_expert_intermediate_size": 48},
    "DeepseekV3ForCausalLM": {"num_attention_heads": 4, "num_key_value_heads": 4,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 32, "first_k_dense_replace": 1, "q_lora_rank": 24,
        "n_group": 4, "topk_group": 2, "norm_topk_prob": True},
}  # fmt: skip


@pytest.mark.parametrize("arch", list(RECORDED))
def test_bf16_decode_steps_are_recorded_and_replay_as_eager(arch, tmp_path):
    """A bf16 MoE model's decode step is native calls only on the CPU (the router and the
    attention projections through the rows kernel, the routing, experts and shared experts in one
    fused_moe call),
    so the engine records it and replays it; the replayed steps give exactly the eager tokens and
    log-probabilities."""
    from llmhal.platforms import get_current_platform

    if not get_current_platform().capabilities.graphs:
        pytest.skip("this platform records no decode graphs")
    cfg = tiny_config(arch, vocab_size=384, initializer_range=0.1, **RECORDED[arch])
    save_tiny_model(cfg, tmp_path)
    make_tokenizer(cfg.vocab_size).save_pretrained(str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)

    def run(**kw):
        llm = LLM(str(tmp_path), dtype="bfloat16", kv_cache_memory_bytes=4 << 20, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    graphs, got = run()
    dg = graphs.engine.runner.decode_graphs
    assert dg is not None and dg.refused is None, dg and dg.refused
    assert dg.replays > 0
    assert got == run(enforce_eager=True)[1]
