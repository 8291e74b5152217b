"""Suffix decoding (vLLM's ``suffix`` method, after Arctic Inference's SuffixDecoding): draft from
what followed the context's latest tokens, both in the request's own tokens and in earlier
requests' responses, guided by how often each continuation occurred.

vLLM runs this on the ``arctic-inference`` package's C++ suffix tree. That package ships only as
source here; building it needs torch >= 2.10 and a C++ toolchain in pip's build isolation, and it
installs a ``vllm.general_plugins`` entry point that imports vLLM in every llmhal process, so
llmhal computes the same statistics itself. Rather than keeping a tree per request and a global
one, it scans token arrays with numpy: for the context's last ``m`` tokens (``m`` up to
``suffix_decoding_max_tree_depth``), every earlier occurrence is found at once, and their
continuations are counted as a suffix tree's node counts would count them:

* per match length ``m``, the draft follows the most frequent next token while its probability
  (its count over the occurrences still matching the draft, multiplied along the draft) stays at
  or above ``suffix_decoding_min_token_prob``; the draft is at most ``max_spec_factor * m`` tokens
  long and ``m`` plus the draft stays within the tree depth (a tree of that depth holds no longer
  paths);
* among the match lengths and the two sources (this request, past responses), the draft with the
  highest score (the sum of its tokens' probabilities: the expected number accepted) wins.

Past responses (the generated tokens of the last ``suffix_decoding_max_cached_requests`` finished
requests, 0: none) are kept in one array with a separator between them, oldest dropped first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from llmhal.spec_decode.ngram import TokenBuffers
from llmhal.spec_decode.proposer import DraftRequest, Proposer

_SEP = -1  # between past responses: never matches a token


def _occurrences(hay: np.ndarray, pattern: np.ndarray, max_m: int, limit: int) -> list[np.ndarray]:
    """``ends[m - 1]``: the positions (< ``limit``) where the last ``m`` tokens of ``pattern`` end
    in ``hay``, for m = 1 .. the longest found (at most ``max_m``)."""
    out: list[np.ndarray] = []
    ends = np.flatnonzero(hay[:limit] == pattern[-1])
    m = 1
    while ends.size:
        out.append(ends)
        if m >= max_m or m >= len(pattern):
            break
        starts = ends - m
        ok = starts >= 0
        ok[ok] = hay[starts[ok]] == pattern[-1 - m]
        ends = ends[ok]
        m += 1
    return out


def _grow(hay: np.ndarray, ends: np.ndarray, max_len: int, min_prob: float) -> tuple[list[int], float]:  # fmt: skip
    """The draft that follows occurrences ``ends`` in ``hay`` (most frequent continuation first),
    and its score."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    pos = ends + 1
    n = len(hay)
    while len(draft) < max_len:
        pos = pos[pos < n]
        if not pos.size:
            break
        if pos.size == 1:
            # One occurrence: each next token has probability 1, so the draft is its continuation
            # up to a separator (what the general step below gives token by token, ~10x faster).
            start = int(pos[0])
            run = hay[start : start + max_len - len(draft)]
            cut = np.flatnonzero(run == _SEP)
            for token in (run[: cut[0]] if cut.size else run).tolist():
                draft.append(token)
                score += prob
            break
        nxt = hay[pos]
        first = nxt[0]
        if first != _SEP and (nxt == first).all():  # all agree: probability 1, no counting
            token = int(first)
        else:
            nxt_valid = nxt[nxt != _SEP]
            if not nxt_valid.size:
                break
            tokens, counts = np.unique(nxt_valid, return_counts=True)
            best = int(counts.argmax())
            # Over all occurrences, those that end here included (a node's count in a tree).
            prob *= counts[best] / pos.size
            if prob < min_prob:
                break
            token = int(tokens[best])
        draft.append(token)
        score += prob
        pos = pos[nxt == token] + 1
    return draft, score


class SuffixProposer(Proposer):
    config_keys: ClassVar[frozenset[str]] = frozenset(
        {
            "suffix_decoding_max_tree_depth",
            "suffix_decoding_max_cached_requests",
            "suffix_decoding_max_spec_factor",
            "suffix_decoding_min_token_prob",
        }
    )
    default_num_speculative_tokens: ClassVar[int] = 24  # vLLM's: the tree depth

    @staticmethod
    def settings(config: Any) -> tuple[int, int, float, float]:
        """(tree depth, cached requests, spec factor, min token probability), vLLM's defaults."""
        x = config.extra
        return (
            x.get("suffix_decoding_max_tree_depth", 24),
            x.get("suffix_decoding_max_cached_requests", 10000),
            x.get("suffix_decoding_max_spec_factor", 1.0),
            x.get("suffix_decoding_min_token_prob", 0.1),
        )

    @classmethod
    def check_config(cls, config: Any) -> None:
        depth, cached, factor, min_prob = cls.settings(config)
        _check("suffix_decoding_max_tree_depth", depth, int, 1, None)
        _check("suffix_decoding_max_cached_requests", cached, int, 0, None)
        _check("suffix_decoding_max_spec_factor", factor, (int, float), 0, None)
        _check("suffix_decoding_min_token_prob", min_prob, (int, float), 0, 1)

    def __init__(self, config: Any, engine_config: Any) -> None:
        super().__init__(config, engine_config)
        self.depth, self.max_cached, self.factor, self.min_prob = self.settings(config)
        self._buffers = TokenBuffers()
        self._prompt_len: dict[str, int] = {}
        self._responses: deque[np.ndarray] = deque()
        self._past: np.ndarray = np.empty(0, dtype=np.int64)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            tokens = self._buffers.tokens(r)
            self._prompt_len[r.request_id] = len(r.prompt_token_ids)
            pattern = tokens[-self.depth :]
            # The highest score wins, the first in (source, match length) order on a tie. A draft
            # of at most `cap` tokens scores at most `cap` (each token's probability is <= 1), so
            # the longest matches go first and a match whose cap cannot beat the best so far is
            # not grown (the same draft as growing every one: ~2x fewer proposer calls' time).
            best_score, best_order, best_draft = 0.0, -1, []
            for src, (hay, limit) in enumerate(((tokens, len(tokens) - 1), (self._past, len(self._past)))):  # fmt: skip
                found = _occurrences(hay, pattern, self.depth, limit)
                for m in range(len(found), 0, -1):
                    cap = min(r.max_draft, int(self.factor * m), self.depth - m)
                    order = src * (self.depth + 1) + m
                    if cap <= 0 or cap < best_score or (cap == best_score and order > best_order):
                        continue
                    draft, score = _grow(hay, found[m - 1], cap, self.min_prob)
                    if score > best_score or (score == best_score and score > 0 and order < best_order):  # fmt: skip
                        best_score, best_order, best_draft = score, order, draft
            out.append(best_draft)
        return out

    def forget_past(self) -> None:
        """Drop the cached responses of finished requests (``llmhal bench spec`` calls this
        before each timed run, so a run never drafts from its own prompts' earlier answers)."""
        self._responses.clear()
        self._past = np.empty(0, dtype=np.int64)

    def finish(self, request_id: str) -> None:
        tokens = self._buffers.pop(request_id)
        p = self._prompt_len.pop(request_id, None)
        if tokens is None or p is None or not self.max_cached or len(tokens) <= p:
            return
        self._responses.append(np.append(tokens[p:], _SEP))
        while len(self._responses) > self.max_cached:
            self._responses.popleft()
        self._past = np.concatenate(self._responses)


def _check(key: str, value: Any, kind: Any, lo: float, hi: float | None) -> None:
    if isinstance(value, bool) or not isinstance(value, kind) or value < lo or (hi is not None and value > hi):  # fmt: skip
        bound = f"in [{lo}, {hi}]" if hi is not None else f"at least {lo}"
        raise ValueError(f"speculative_config[{key!r}]={value!r} must be a number {bound}")
