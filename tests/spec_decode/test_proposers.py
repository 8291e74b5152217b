"""The built-in proposers against plain-Python statements of their rules."""

from __future__ import annotations

import random

import numpy as np
import pytest

from llmhal.spec_decode.config import SpeculativeConfig
from llmhal.spec_decode.ngram import NgramProposer, ngram_draft
from llmhal.spec_decode.proposer import DraftRequest
from llmhal.spec_decode.suffix import SuffixProposer


def naive_ngram(tokens: list[int], lo: int, hi: int, k: int, factor: float | None = None) -> list[int]:  # fmt: skip
    """vLLM's rule: the longest n in [lo, hi] whose last-n tokens occurred before, at the earliest
    occurrence; the (at most k) tokens that followed it; with llmhal's factor, at most factor * n."""
    n_tok = len(tokens)
    for n in range(min(hi, n_tok - 1), lo - 1, -1):
        suffix = tokens[n_tok - n :]
        for i in range(n_tok - n):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + (k if factor is None else min(k, int(factor * n)))]
    return []


def test_ngram_matches_the_rule_on_random_sequences():
    rng = random.Random(0)
    for _ in range(400):
        alphabet = rng.randint(2, 6)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(1, 60))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 6)
        k = rng.randint(1, 8)
        factor = rng.choice([None, 0.5, 1, 1.5, 2])  # prompt_lookup_max_spec_factor
        got = ngram_draft(np.array(tokens, dtype=np.int64), lo, hi, k, factor).tolist()
        assert got == naive_ngram(tokens, lo, hi, k, factor), (tokens, lo, hi, k, factor)


def _req(rid, prompt, output=(), k=5):
    return DraftRequest(rid, list(prompt), list(output), k)


def test_ngram_proposer_keeps_growing_buffers():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3})  # fmt: skip
    prop = NgramProposer(cfg, None)
    prompt = [1, 2, 3, 4, 5, 9, 1, 2]
    assert prop.propose([_req("a", prompt, k=3)]) == [[3, 4, 5]]
    out = [3]
    assert prop.propose([_req("a", prompt, out, k=3)]) == [[4, 5, 9]]
    prop.finish("a")
    assert prop.propose([_req("a", [7, 8], k=3)]) == [[]]


def test_ngram_spec_factor_sizes_drafts_by_the_match():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 1, "prompt_lookup_max": 8, "prompt_lookup_max_spec_factor": 2})  # fmt: skip
    prop = NgramProposer(cfg, None)
    passage = list(range(10, 30))
    # A 1-gram match drafts 2 tokens, a 3-gram 6, a 5-gram the cap of 7.
    for n, want in ((1, 2), (3, 6), (5, 7)):
        (draft,) = prop.propose([_req(str(n), [1, *passage, 2, *passage[:n]], k=7)])
        assert draft == passage[n : n + want]
    with pytest.raises(ValueError, match="prompt_lookup_max_spec_factor"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max_spec_factor": 0})  # fmt: skip


def _suffix(**extra):
    cfg = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 8, **extra})
    return SuffixProposer(cfg, None)


def test_suffix_drafts_from_the_requests_own_tokens():
    prop = _suffix()
    passage = [10, 11, 12, 13, 14, 15, 16, 17]
    # The passage, then its first four tokens again: the rest of it is drafted (as long as the
    # match, with max_spec_factor 1).
    assert prop.propose([_req("a", [1, *passage, 2, *passage[:4]])]) == [passage[4:8]]


def test_suffix_drafts_from_earlier_responses_and_respects_min_token_prob():
    prop = _suffix(suffix_decoding_max_spec_factor=2.0)
    answer = [20, 21, 22, 23, 24, 25]
    prop.propose([_req("a", [1, 2], answer)])
    prop.finish("a")  # its response joins the cache
    assert prop.propose([_req("b", [3, 4], answer[:2])]) == [answer[2:6]]
    # Two earlier responses continue the same tokens two ways, half and half: below 0.6 nothing.
    picky = _suffix(suffix_decoding_min_token_prob=0.6)
    for rid, tail in (("x", [30]), ("y", [31])):
        picky.propose([_req(rid, [1], [7, 8, *tail])])
        picky.finish(rid)
    assert picky.propose([_req("c", [2], [7, 8])]) == [[]]
    assert _suffix(suffix_decoding_max_cached_requests=0).propose([_req("d", [2], [7, 8])]) == [[]]


def naive_suffix(context: list[int], past: list[list[int]], depth: int, factor: float, min_prob: float, k: int) -> list[int]:  # fmt: skip
    """Suffix decoding's rule stated directly: for each source (the context, then the past
    responses) and each match length m (the context's last m tokens occurred there, m <= depth),
    follow the most frequent next token (the smallest on a tie) while the product of its shares
    stays >= min_prob, for at most min(k, factor * m, depth - m) tokens; the highest sum of those
    products wins, the first found on a tie."""
    best: tuple[float, list[int]] = (0.0, [])
    sources = [(context, len(context) - 1), ([t for r in past for t in (*r, None)], None)]
    for hay, limit in sources:
        limit = len(hay) if limit is None else limit
        for m in range(1, min(depth, len(context)) + 1):
            pat = context[-m:]
            ends = [e for e in range(m - 1, limit) if hay[e - m + 1 : e + 1] == pat]
            cap = min(k, int(factor * m), depth - m)
            if not ends or cap <= 0:
                continue
            draft, prob, score, pos = [], 1.0, 0.0, [e + 1 for e in ends]
            while len(draft) < cap:
                pos = [p for p in pos if p < len(hay)]
                nxt = [hay[p] for p in pos if hay[p] is not None]
                if not nxt:
                    break
                token = min(set(nxt), key=lambda t: (-nxt.count(t), t))
                prob *= nxt.count(token) / len(pos)
                if prob < min_prob:
                    break
                draft.append(token)
                score += prob
                pos = [p + 1 for p in pos if hay[p] == token]
            if score > best[0]:
                best = (score, draft)
    return best[1]


@pytest.mark.parametrize("extra", [{}, {"suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_min_token_prob": 0.3, "suffix_decoding_max_tree_depth": 6}])  # fmt: skip
def test_suffix_matches_the_rule_stated_directly(extra):
    """The vectorised proposer (its shortcuts: one occurrence or agreeing ones taken whole, matches
    whose cap cannot win skipped) drafts exactly what the rule gives, on small vocabularies where
    repeats, ties and past responses are common."""
    rng = random.Random(5)
    prop = _suffix(**extra)
    depth, _, factor, min_prob = SuffixProposer.settings(prop.config)
    past: list[list[int]] = []
    for rid in range(12):
        prompt = [rng.randrange(5) for _ in range(rng.randrange(2, 12))]
        out: list[int] = []
        for _ in range(rng.randrange(1, 25)):
            (got,) = prop.propose([_req(str(rid), prompt, out, k=8)])
            assert got == naive_suffix(prompt + out, past, depth, factor, min_prob, 8)
            out.append(rng.randrange(5))
        prop.finish(str(rid))
        past.append(out[:-1])  # what the proposer saw: the last token came after its last call


@pytest.mark.parametrize("k", [1, 3])
def test_drafts_never_exceed_max_draft(k):
    prop = _suffix()
    passage = list(range(40, 60))
    assert len(prop.propose([_req("a", passage + passage[:10], k=k)])[0]) <= k
