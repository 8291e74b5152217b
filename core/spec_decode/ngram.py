"""N-gram drafting (vLLM's ``ngram``, "prompt lookup"): find the longest n-gram (``prompt_lookup_min``
to ``prompt_lookup_max`` tokens) that ends the request's tokens and occurred before, at its earliest
occurrence, and propose the tokens that followed it there.

``prompt_lookup_max_spec_factor`` (llmhal's, not vLLM's; like suffix decoding's
``max_spec_factor``) sizes the draft by the evidence: at most that many tokens per matched token,
so a long match drafts up to ``num_speculative_tokens`` and a 1-gram match only a few. Where a
verification step costs more with every row (a CPU), fewer tokens are then verified in vain.

Vectorised with numpy: the candidates are the earlier positions holding the last token; each step
of up to ``prompt_lookup_max`` compares all surviving candidates' preceding token at once, so a
2000-token context costs a few array operations, not a Python loop over positions. Each request's
tokens live in a growing numpy buffer, extended by the new tokens at each call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from llmhal.spec_decode.proposer import DraftRequest, Proposer


def ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int, factor: float | None = None) -> np.ndarray:  # fmt: skip
    """The draft for one context (see the module docstring): at most ``k`` tokens, maybe none;
    with ``factor``, at most ``factor`` times the matched n-gram's length too."""
    n = len(tokens)
    if n < min_n + 1 or k <= 0:
        return tokens[:0]
    last = n - 1
    # Ends of earlier occurrences of the last token (the suffix itself is not a candidate).
    ends = np.flatnonzero(tokens[:last] == tokens[last])
    length = 1
    while ends.size and length < max_n:
        starts = ends - length
        ok = starts >= 0
        ok[ok] = tokens[starts[ok]] == tokens[last - length]
        if not ok.any():
            break
        ends = ends[ok]
        length += 1
    if not ends.size or length < min_n:
        return tokens[:0]
    first = int(ends[0]) + 1  # the earliest longest occurrence
    if factor is not None:
        k = min(k, int(factor * length))
    return tokens[first : first + k]


class TokenBuffers:
    """Each request's committed tokens as a numpy array, grown in place by the new tokens at each
    call (committed tokens never change) instead of copied from the lists every step."""

    def __init__(self) -> None:
        self._bufs: dict[str, tuple[np.ndarray, int]] = {}

    def tokens(self, req: DraftRequest) -> np.ndarray:
        buf, have = self._bufs.get(req.request_id, (None, 0))
        n = req.num_tokens
        if buf is None or len(buf) < n:
            grown = np.empty(max(2 * n, 64), dtype=np.int64)
            if buf is not None:
                grown[:have] = buf[:have]
            buf = grown
        p = len(req.prompt_token_ids)
        if have < p:
            buf[have:p] = req.prompt_token_ids[have:]
            have = p
        if have < n:
            buf[have:n] = req.output_token_ids[have - p :]
        self._bufs[req.request_id] = (buf, n)
        return buf[:n]

    def pop(self, request_id: str) -> np.ndarray | None:
        """Forget a request; its tokens (None if it had none)."""
        buf, n = self._bufs.pop(request_id, (None, 0))
        return None if buf is None else buf[:n]


class NgramProposer(Proposer):
    config_keys: ClassVar[frozenset[str]] = frozenset(
        {"prompt_lookup_min", "prompt_lookup_max", "prompt_lookup_max_spec_factor"}
    )

    @staticmethod
    def lookup_range(config: Any) -> tuple[int, int]:
        """(prompt_lookup_min, prompt_lookup_max), with vLLM's defaults: both 5 when neither is
        given, one given sets the other."""
        lo, hi = config.extra.get("prompt_lookup_min"), config.extra.get("prompt_lookup_max")
        lo, hi = (lo if lo is not None else hi), (hi if hi is not None else lo)
        return (lo if lo is not None else 5), (hi if hi is not None else 5)

    @classmethod
    def check_config(cls, config: Any) -> None:
        lo, hi = cls.lookup_range(config)
        for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(
                    f"speculative_config[{key!r}]={v!r} must be a positive integer (n-gram length)"
                )
        if lo > hi:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({lo}) is more than prompt_lookup_max "
                f"({hi}); make min <= max"
            )
        factor = config.extra.get("prompt_lookup_max_spec_factor")
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0):  # fmt: skip
            raise ValueError(
                f"speculative_config['prompt_lookup_max_spec_factor']={factor!r} must be a "
                "positive number (drafts per matched token), or left out for "
                "num_speculative_tokens whatever the match"
            )

    def __init__(self, config: Any, engine_config: Any) -> None:
        super().__init__(config, engine_config)
        self.min_n, self.max_n = self.lookup_range(config)
        self.factor: float | None = config.extra.get("prompt_lookup_max_spec_factor")
        self._buffers = TokenBuffers()

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [
            ngram_draft(
                self._buffers.tokens(r), self.min_n, self.max_n, r.max_draft, self.factor
            ).tolist()
            for r in requests
        ]

    def finish(self, request_id: str) -> None:
        self._buffers.pop(request_id)
