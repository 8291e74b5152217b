"""The rejection sampler: greedy acceptance is exact, and sampled acceptance keeps the target's
distribution (chi-square over thousands of draws on synthetic distributions)."""

from __future__ import annotations

import pytest
import torch

from llmhal.spec_decode.rejection_sampler import accept_greedy, accept_sampled


def chi_square_p(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """The chi-square goodness-of-fit p-value (cells with tiny expectations merged)."""
    n = float(observed.sum())
    expected = expected_probs.double() * n
    order = expected.argsort(descending=True)
    keep = order[expected[order] >= 5]
    rest = order[expected[order] < 5]
    obs = torch.cat([observed.double()[keep], observed.double()[rest].sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[rest].sum().reshape(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def test_greedy_accepts_the_agreeing_prefix_then_the_target_token():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # second rejected, target's own
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert accept_greedy([3], []) == [3]


def _random_dist(gen: torch.Generator, vocab: int, sharpness: float) -> torch.Tensor:
    return torch.softmax(torch.randn(vocab, generator=gen) * sharpness, -1)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_sampled_acceptance_keeps_the_target_distribution(with_draft_probs):
    """Two verified positions whose target rows do not depend on history: the first emitted token
    must follow p0 and, where a second is emitted, it must follow p1, whatever the drafter
    proposes (one-hot drafts of a fixed token, or drafts drawn from a different q)."""
    gen = torch.Generator().manual_seed(1234)
    vocab = 12
    p = torch.stack([_random_dist(gen, vocab, 1.5) for _ in range(3)])
    q = torch.stack([_random_dist(gen, vocab, 2.0) for _ in range(2)])
    draws = 3000
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(draws):
        if with_draft_probs:
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
            out = accept_sampled(p, drafts, q, gen)
        else:
            out = accept_sampled(p, [int(p[0].argmax()), 3], None, gen)
        assert 1 <= len(out) <= 3
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert chi_square_p(first, p[0]) > 1e-3
    assert second.sum() > 300  # the fixed or q-drawn first draft is accepted often enough
    assert chi_square_p(second, p[1]) > 1e-3


def test_a_token_the_target_rules_out_is_never_accepted():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    for _ in range(200):
        out = accept_sampled(p, [0], None, gen)
        assert out[0] != 0 and len(out) == 1


def test_chi_square_helper_rejects_a_wrong_distribution():
    gen = torch.Generator().manual_seed(5)
    p = _random_dist(gen, 8, 1.5)
    wrong = torch.roll(p, 1)
    counts = torch.bincount(torch.multinomial(wrong, 4000, True, generator=gen), minlength=8)
    assert chi_square_p(counts.float(), p) < 1e-6
    counts = torch.bincount(torch.multinomial(p, 4000, True, generator=gen), minlength=8)
    assert chi_square_p(counts.float(), p) > 1e-3
