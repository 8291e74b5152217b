"""Sampled speculative decoding keeps the target's distribution, end to end on a tiny model: the
second generated token's frequencies over thousands of requests, each verifying drafts, against the
exact marginal computed with HF transformers (the reference)."""

from __future__ import annotations

import pytest
import torch

from llmhal import SamplingParams

PROMPT = [5, 6, 7]
# Below 1, so the distributions are peaked enough for drafts to be accepted often.
TEMPERATURE = 0.3


def _chi_square_p(observed: torch.Tensor, probs: torch.Tensor) -> float:
    n = float(observed.sum())
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([observed.double()[big], observed.double()[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    stat = float(((obs - exp) ** 2 / exp.clamp_min(1e-12)).sum())
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2.0), torch.tensor(stat / 2)))  # fmt: skip


@pytest.fixture(scope="module")
def second_token_marginal(tiny_folder):
    """P(t2) = sum over t1 of P(t1 | prompt) P(t2 | prompt, t1), from transformers (at the
    sampling temperature)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([PROMPT])).logits[0, -1].double() / TEMPERATURE, -1)
        vocab = p1.numel()
        seqs = torch.tensor([PROMPT + [t] for t in range(vocab)])
        p2 = torch.softmax(hf(seqs).logits[:, -1].double() / TEMPERATURE, -1)
    return p1 @ p2


@pytest.mark.slow  # ~10-20 s: 4000 requests (the rule itself is checked fast in test_rejection_sampler)
def test_second_token_follows_the_target_marginal(new_llm, fixed_proposer, second_token_marginal):
    marginal = second_token_marginal
    # The drafter proposes the likeliest second token, then a likely third: both accepted often,
    # rejected often too, so both branches of the rule are exercised.
    top = marginal.topk(2).indices.tolist()
    fixed_proposer.tokens = top
    llm = new_llm({"method": "test_fixed", "num_speculative_tokens": 2}, max_num_seqs=128, max_num_batched_tokens=512)  # fmt: skip
    n = 4000
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * n, SamplingParams(temperature=TEMPERATURE, max_tokens=4, ignore_eos=True))  # fmt: skip
    second = torch.bincount(torch.tensor([o.outputs[0].token_ids[1] for o in outs]), minlength=marginal.numel())  # fmt: skip
    stats = llm.engine.speculator.stats
    assert stats.num_drafts >= n  # every request verified drafts after its first token
    assert 0.05 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.95
    assert _chi_square_p(second.float(), marginal) > 1e-3
    # The same test rejects a distribution that is slightly off (it has the power to).
    shifted = marginal.clone()
    shifted[top[0]] *= 1.5
    assert _chi_square_p(second.float(), shifted / shifted.sum()) < 1e-3
