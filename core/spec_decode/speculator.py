"""The engine's side of speculative decoding: who drafts, how many, verification, statistics.

The engine owns one :class:`Speculator` when a speculative config is given. After each step it
calls :meth:`propose` with the requests that just got a token; their drafts go to
``Request.spec_token_ids``, and the scheduler runs them with the last token as one chunk. In the
next step :meth:`verify` turns the target's ``1 + k`` rows per request into the tokens to emit.

Requests with a structured-output grammar do not speculate: the grammar backends here
(xgrammar, llguidance) would have to roll back the tokens a rejection takes back, and llmhal's
grammar wrapper has no rollback yet, so such requests decode one token per step as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from llmhal.engine.outputs import Logprob
from llmhal.engine.request import Request
from llmhal.engine.sampler import Sampler, greedy_tokens, logprob_entries
from llmhal.spec_decode.config import SpeculativeConfig
from llmhal.spec_decode.proposer import DraftRequest, Proposer
from llmhal.spec_decode.rejection_sampler import accept_greedy, accept_sampled


@dataclass
class SpecDecodingStats:
    """Totals since the engine started (vLLM's counters): verified drafts, their tokens, the
    tokens accepted, and per draft position how often it was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step: 1 (the target's own) + accepted drafts per draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for j in range(num_accepted):
            per_pos[j] += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "mean_acceptance_length": round(self.mean_acceptance_length, 3),
        }


class _DraftView:
    """A request as it would be after its first ``len(drafts)`` drafts were accepted: the sampler
    reads its output (penalties, bad words, min_tokens) through this, so each verified position is
    processed exactly as non-speculative sampling would process it."""

    __slots__ = ("_req", "output_token_ids")

    def __init__(self, req: Request, drafts: list[int]) -> None:
        self._req = req
        self.output_token_ids = req.output_token_ids + drafts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._req, name)


@dataclass
class Verified:
    """One request's verification: the tokens to emit (with their log-probabilities when asked
    for), how many drafts were accepted, and whether the request ends without a further token
    (a position where its settings left no token)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob] | None]
    num_accepted: int
    dead: bool = False


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats(
            num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens
        )
        self.step_stats: SpecDecodingStats | None = None  # this step's, for the stat loggers
        self._history: dict[str, list[int]] = {}  # request -> [drafts, draft tokens, accepted]
        self._off: set[str] = set()  # requests the adaptive switch stopped

    def reset_stats(self) -> None:
        self.stats = SpecDecodingStats(
            num_accepted_tokens_per_pos=[0] * self.config.num_speculative_tokens
        )
        self.step_stats = None

    # ------------------------------------------------------------------------ drafting
    def _max_draft(self, req: Request) -> int:
        if req.grammar is not None or req.request_id in self._off:
            return 0
        # Every emitted token may be the last (max_tokens, the context), and the verified chunk
        # must fit the context: the drafts never reach past either.
        return min(
            self.config.num_speculative_tokens,
            req.max_tokens - len(req.output_token_ids) - 1,
            self.max_model_len - req.num_tokens,
        )

    def propose(self, requests: Sequence[Request], num_running: int) -> None:
        """Set ``spec_token_ids`` of each of ``requests`` (running, just given a token)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running >= limit:
            return
        todo = []
        for req in requests:
            k = self._max_draft(req)
            if k > 0:
                todo.append(DraftRequest(req.request_id, req.prompt_token_ids, req.output_token_ids, k))  # fmt: skip
        if not todo:
            return
        drafts = self.proposer.propose(todo)
        if len(drafts) != len(todo):
            raise RuntimeError(
                f"{type(self.proposer).__name__}.propose returned {len(drafts)} drafts for "
                f"{len(todo)} requests"
            )
        by_id = {r.request_id: r for r in requests}
        for dreq, draft in zip(todo, drafts, strict=True):
            by_id[dreq.request_id].spec_token_ids = [int(t) for t in draft[: dreq.max_draft]]

    def finish(self, request_id: str) -> None:
        self._history.pop(request_id, None)
        self._off.discard(request_id)
        self.proposer.finish(request_id)

    # ---------------------------------------------------------------------- verifying
    def verify(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        sampler: Sampler,
        grammars: Any = None,
    ) -> list[Verified]:
        """``logits`` has ``1 + len(r.spec_token_ids)`` rows per request, in order. ``grammars``
        (a callable taking the logits and one grammar or None per row) applies structured-output
        masks; rows of requests with drafts never have one."""
        views: list[Any] = []
        spans = []
        for req in requests:
            spans.append((len(views), len(req.spec_token_ids)))
            views.append(req)
            views.extend(_DraftView(req, req.spec_token_ids[:j]) for j in range(1, len(req.spec_token_ids) + 1))  # fmt: skip
        if grammars is not None:
            grammars(logits, views)
        want = [i for i, v in enumerate(views) if v.params.logprobs is not None]
        raw = logits[want].float() if want else None
        dead = sampler.process(logits, views)
        argmax = greedy_tokens(logits).tolist()
        random_rows = [i for i, v in enumerate(views) if not v.params.greedy]
        probs = sampler.random_probs(logits, views, random_rows) if random_rows else None
        prob_row = {i: j for j, i in enumerate(random_rows)}
        out: list[Verified] = []
        for req, (first, k) in zip(requests, spans, strict=True):
            drafts = req.spec_token_ids
            if req.params.greedy:
                tokens = accept_greedy(argmax[first : first + k + 1], drafts)
            else:
                assert probs is not None
                rows = probs[prob_row[first] : prob_row[first] + k + 1]
                gen = req.generator or sampler.default_generator
                tokens = accept_sampled(rows, drafts, None, gen)
            accepted = len(tokens) - 1
            if k:
                self._record(req.request_id, k, accepted)
            ended = next((j for j in range(len(tokens)) if first + j in dead), None)
            if ended is not None:
                tokens = tokens[:ended]
            out.append(Verified(tokens, [None] * len(tokens), accepted, ended is not None))
        if raw is not None:
            self._logprobs(raw, want, spans, requests, out)
        return out

    @staticmethod
    def _logprobs(raw: torch.Tensor, want: list[int], spans: list[tuple[int, int]], requests: Sequence[Request], out: list[Verified]) -> None:  # fmt: skip
        """Fill each emitted token's log-probability entry from its row's raw logits."""
        pos = {row: i for i, row in enumerate(want)}
        rows, tokens, tops, where = [], [], [], []
        for req, (first, _), v in zip(requests, spans, out, strict=True):
            if req.params.logprobs is None:
                continue
            for j, t in enumerate(v.tokens):
                rows.append(pos[first + j])
                tokens.append(t)
                tops.append(req.params.logprobs or 0)
                where.append((v, j))
        if not rows:
            return
        lp = torch.log_softmax(raw[torch.tensor(rows)], -1)
        for (v, j), entry in zip(where, logprob_entries(lp, tokens, tops), strict=True):
            v.logprobs[j] = entry

    def take_step_stats(self) -> SpecDecodingStats | None:
        """The verifications since the previous call (None: none)."""
        stats, self.step_stats = self.step_stats, None
        return stats

    def _record(self, request_id: str, k: int, accepted: int) -> None:
        self.stats.add(k, accepted)
        if self.step_stats is None:
            self.step_stats = SpecDecodingStats(
                num_accepted_tokens_per_pos=[0] * self.config.num_speculative_tokens
            )
        self.step_stats.add(k, accepted)
        rate = self.config.disable_below_acceptance_rate
        if not rate:
            return
        h = self._history.setdefault(request_id, [0, 0, 0])
        h[0] += 1
        h[1] += k
        h[2] += accepted
        if h[0] >= self.config.min_drafts_before_disable and h[2] < rate * h[1]:
            self._off.add(request_id)
