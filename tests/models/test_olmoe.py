"""OLMoE against HF transformers on tiny random checkpoints (fp32): the whole-width q/k norms, the
``clip_qkv`` clamp and softmax top-k routing, through the same parity run as the other MoE models
(four prompts of 1 to 23 tokens in one varlen prefill, batched greedy decode; 8 steps in the fast
tier, 64 in the slow one)."""

from __future__ import annotations

import pytest
import torch

from llmhal.testing.model_parity import build_model, check_parity, save_tiny_model, tiny_config

CASES = {
    "top2-of-8-no-renorm": {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32},
    # 0.5 is below most normed q/k values: the clamp changes the logits, so parity tests it.
    "renorm-clip-qkv": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 48,
        "norm_topk_prob": True,
        "clip_qkv": 0.5,
    },
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[str, tuple[object, object]] = {}

    def get(case: str):
        if case not in made:
            folder = tmp_path_factory.mktemp(case)
            cfg = tiny_config("OlmoeForCausalLM", initializer_range=0.1, **CASES[case])
            made[case] = (save_tiny_model(cfg, folder), folder)
        return made[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf(case, checkpoints):
    hf, folder = checkpoints(case)
    check_parity(hf, folder, decode_steps=8, rel_tol=1e-4).raise_on_failure()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf_for_64_steps(case, checkpoints):
    hf, folder = checkpoints(case)
    report = check_parity(hf, folder, decode_steps=64, rel_tol=1e-4)
    report.raise_on_failure()
    assert all(len(t) == 64 for t in report.tokens.values())


def test_norms_span_every_head(checkpoints):
    hf, folder = checkpoints("renorm-clip-qkv")
    model, _ = build_model(folder)
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (64,) and attn.k_norm.weight.shape == (32,)
    assert torch.equal(attn.q_norm.weight, hf.model.layers[0].self_attn.q_norm.weight)
    assert attn.clip_qkv == 0.5


def test_tensor_parallelism_is_refused_by_name(checkpoints, monkeypatch):
    """The whole-width q/k norms need every head on one rank: a TP rank's share is refused."""
    import llmhal.layers.linear as linear

    _, folder = checkpoints("renorm-clip-qkv")
    monkeypatch.setattr(linear, "tp_rank_and_size", lambda: (0, 2))
    with pytest.raises(NotImplementedError, match="tensor_parallel_size=1"):
        build_model(folder)
