"""The engine's side of speculative decoding: who drafts, how many, verification, statistics.

The engine owns one :class:`Speculator` when a speculative config is given. After each step it
calls :meth:`propose` with the requests that just got a token; their drafts go to
``Request.spec_token_ids``, and the scheduler runs them with the last token as one chunk. In the
next step :meth:`verify` turns the target's ``1 + k`` rows per request into the tokens to emit.

Requests with a structured-output grammar speculate too: their drafts are cut to the longest
prefix the grammar accepts (``validate_tokens``), and each verified position is masked by the
grammar as it would be after the drafts before it (accepted one by one while the masks are filled,
then rolled back, so the grammar advances only over the tokens finally emitted). While a reasoning
gate holds a request's grammar back, it does not speculate (where the reasoning ends inside a draft
run, the rows after it would need the grammar's masks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from llmhal.engine.outputs import Logprob
from llmhal.engine.request import Request
from llmhal.engine.sampler import Sampler, greedy_tokens, logprob_entries
from llmhal.spec_decode.adaptive import AdaptiveSwitch
from llmhal.spec_decode.config import SpeculativeConfig
from llmhal.spec_decode.proposer import DraftRequest, Proposer
from llmhal.spec_decode.rejection_sampler import accept_greedy, accept_sampled
from llmhal.spec_decode.tree_verify import (
    DraftTree,
    TreeDraft,
    accept_greedy_tree,
    accept_sampled_tree,
    compact_path_kv,
)


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

    __slots__ = ("_req", "grammar", "output_token_ids")

    def __init__(self, req: Request, drafts: list[int], grammar: Any = None) -> None:
        self._req = req
        self.output_token_ids = req.output_token_ids + drafts
        self.grammar = grammar

    def __getattr__(self, name: str) -> Any:
        return getattr(self._req, name)


class _GrammarAhead:
    """A request's grammar as it is after its first ``j`` drafts, for the structured-output
    manager, which fills the rows of one request in order: row ``j`` accepts draft ``j - 1``
    before filling its mask. :meth:`restore` takes the drafts back afterwards."""

    def __init__(self, grammar: Any, drafts: list[int]) -> None:
        self.grammar = grammar
        self.drafts = drafts
        self.accepted = 0

    def at(self, j: int) -> Any:
        return _GrammarRow(self, j)

    def advance_to(self, j: int) -> None:
        if self.accepted > j:  # rows filled out of order: step back
            self.grammar.rollback(self.accepted - j)
            self.accepted = j
        while self.accepted < j:
            if not self.grammar.accept_tokens("", [self.drafts[self.accepted]]):
                raise RuntimeError("a draft the grammar validated was refused")
            self.accepted += 1

    def restore(self) -> None:
        self.grammar.rollback(self.accepted)
        self.accepted = 0


class _GrammarRow:
    __slots__ = ("ahead", "j")

    def __init__(self, ahead: _GrammarAhead, j: int) -> None:
        self.ahead, self.j = ahead, j

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.ahead.advance_to(self.j)
        if self.ahead.grammar.is_terminated():
            # A draft before this row completed the output: nothing may follow (the row is dead,
            # and a run that reaches it ends with that draft, as plain decoding would).
            bitmask[index].fill_(0)
        else:
            self.ahead.grammar.fill_bitmask(bitmask, index)


@dataclass
class Verified:
    """One request's verification: the tokens to emit (with their log-probabilities when asked
    for), how many drafts were accepted, and whether the request ends without a further token
    (a position where its settings left no token)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob] | None]
    num_accepted: int
    dead: bool = False
    # The chunk row each token came from, for a tree (None: row j for token j).
    rows: list[int] | None = None


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats(
            num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens
        )
        self.step_stats: SpecDecodingStats | None = None  # this step's, for the stat loggers
        self.runner: Any = None  # the target's runner, for proposers reading its hidden states
        self.adaptive = AdaptiveSwitch(
            config.disable_below_acceptance_rate,
            config.disable_when_slower,
            config.min_drafts_before_disable,
            config.retry_after_steps,
        )
        # For proposers drafting from the target's hidden states: per request, the first position
        # not yet handed to the proposer and the rows computed since (see keep_hidden).
        self.wants_hidden = bool(getattr(proposer, "uses_target_hidden_states", False))
        self._hidden: dict[str, tuple[int, list[torch.Tensor]]] = {}
        # Requests whose drafts are a tree (see llmhal.spec_decode.tree_verify): its shape, read by
        # the model runner to build the tree mask and positions.
        self.trees: dict[str, DraftTree] = {}

    def reset_stats(self) -> None:
        self.stats = SpecDecodingStats(
            num_accepted_tokens_per_pos=[0] * self.config.num_speculative_tokens
        )
        self.step_stats = None

    # ------------------------------------------------------------------------ drafting
    def _max_draft(self, req: Request) -> int:
        if req.reasoning_ended is False or not self.adaptive.allows(req.request_id):
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
        # Called once per step: the step that just ended is timed, and the next one counts towards
        # the waits of the requests the adaptive switch stopped.
        ids = [r.request_id for r in requests]
        self.adaptive.step_done(ids)
        try:
            self._propose(requests, num_running)
        finally:
            self.adaptive.count_down(ids)
        if self.wants_hidden and self.runner is not None:
            # A step that keeps hidden states runs eagerly (no recorded step replays it): while
            # no request will draft (too many run, or every one is stopped), steps run recorded
            # and keep none. A request that drafts again starts its head over from there (the
            # output is unchanged).
            limit = self.config.disable_by_batch_size
            idle = (limit is not None and num_running >= limit) or self.adaptive.all_stopped(ids)
            self.runner.capture_hidden = not idle

    def _propose(self, requests: Sequence[Request], num_running: int) -> None:
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running >= limit:
            for req in requests:  # no draft now: the next one starts its head over
                self._hidden.pop(req.request_id, None)
            return
        todo = []
        for req in requests:
            k = self._max_draft(req)
            start, rows = self._hidden.pop(req.request_id, (0, []))
            if k > 0:
                hidden = (rows[0] if len(rows) == 1 else torch.cat(rows)) if rows else None
                todo.append(DraftRequest(req.request_id, req.prompt_token_ids, req.output_token_ids, k, hidden, start))  # fmt: skip
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
            req = by_id[dreq.request_id]
            self.trees.pop(req.request_id, None)
            if isinstance(draft, TreeDraft):
                draft = self._tree_or_chain(req, dreq, draft)
                if req.request_id in self.trees:
                    req.spec_token_ids = draft
                    continue
            draft = [int(t) for t in draft[: dreq.max_draft]]
            if draft and req.grammar is not None:  # what the grammar refuses is never verified
                draft = req.grammar.validate_tokens(draft)
            req.spec_token_ids = draft

    def _tree_or_chain(self, req: Request, dreq: DraftRequest, draft: TreeDraft) -> list[int]:
        """A tree draft's tokens, its shape kept in ``trees`` (read by the runner); the leading
        chain alone where the whole tree cannot be verified: too deep for ``max_draft``, past the
        context, or under a grammar (which validates one sequence)."""
        tree = draft.tree
        if len(draft.tokens) != tree.num_nodes:
            raise RuntimeError(f"{type(self.proposer).__name__} returned a tree of {tree.num_nodes} nodes with {len(draft.tokens)} tokens")  # fmt: skip
        if (
            tree.is_chain
            or req.grammar is not None
            or tree.depth > dreq.max_draft
            or req.num_tokens + tree.num_nodes > self.max_model_len
        ):
            return [int(t) for t in draft.tokens[: tree.chain_len]]
        self.trees[req.request_id] = tree
        return [int(t) for t in draft.tokens]

    def keep_hidden(self, items: Sequence[tuple[Request, int]], accepted: dict[str, int]) -> None:
        """Keep the rows of this step's hidden states (``proposer``'s runner captured them) that
        belong to committed tokens: a verified chunk's last token and its ``accepted`` drafts, all
        of any other chunk. Called after verification, before the requests' computed counts move."""
        feats = self.runner.captured_hidden if self.runner is not None else None
        if feats is None:
            return
        self.runner.captured_hidden = None
        row = 0
        for req, n in items:
            keep = n - len(req.spec_token_ids) + accepted.get(req.request_id, 0)
            if req.pooling is None and keep > 0:
                start = req.num_computed_tokens
                got = self._hidden.get(req.request_id)
                if got is not None and got[0] + sum(len(t) for t in got[1]) == start:
                    got[1].append(feats[row : row + keep])
                else:  # first rows, or the target skipped or recomputed positions
                    self._hidden[req.request_id] = (start, [feats[row : row + keep]])
            row += n

    def finish(self, request_id: str) -> None:
        self._hidden.pop(request_id, None)
        self.trees.pop(request_id, None)
        self.adaptive.finish(request_id)
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
        ahead: list[_GrammarAhead] = []
        trees, chains = {}, {}
        for req in requests:
            drafts = req.spec_token_ids
            spans.append((len(views), len(drafts)))
            tree = self.trees.pop(req.request_id, None)
            if tree is not None and drafts:
                if len(drafts) == tree.num_nodes:  # else trimmed: verified as its leading chain
                    trees[req.request_id] = tree
                    # Each node's row is processed with its own path as history.
                    views.append(req)
                    views.extend(_DraftView(req, [drafts[c - 1] for c in tree.path(j)]) for j in range(1, len(drafts) + 1))  # fmt: skip
                    continue
                # Trimmed by the scheduler: verified as its leading chain (rows past it unread).
                chains[req.request_id] = tree.chain_len
            if req.grammar is not None and drafts:
                ahead.append(_GrammarAhead(req.grammar, drafts))
                views.extend(_DraftView(req, drafts[:j], ahead[-1].at(j)) for j in range(len(drafts) + 1))  # fmt: skip
                continue
            views.append(req)
            views.extend(_DraftView(req, drafts[:j], req.grammar) for j in range(1, len(drafts) + 1))  # fmt: skip
        if grammars is not None:
            try:
                grammars(logits, views)
            finally:
                for a in ahead:
                    a.restore()
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
            if req.request_id in chains:
                k = min(k, chains[req.request_id])
                drafts = drafts[:k]
            tree = trees.get(req.request_id)
            path = None
            if tree is not None:
                if req.params.greedy:
                    tokens, path = accept_greedy_tree(argmax[first : first + k + 1], drafts, tree)
                else:
                    assert probs is not None
                    rows = probs[prob_row[first] : prob_row[first] + k + 1]
                    tokens, path = accept_sampled_tree(rows, drafts, tree, req.generator or sampler.default_generator)  # fmt: skip
                self._compact(req, path)
            elif req.params.greedy:
                tokens = accept_greedy(argmax[first : first + k + 1], drafts)
            else:
                assert probs is not None
                rows = probs[prob_row[first] : prob_row[first] + k + 1]
                gen = req.generator or sampler.default_generator
                tokens = accept_sampled(rows, drafts, None, gen)
            accepted = len(tokens) - 1
            if k:
                self._record(req.request_id, k if tree is None else tree.depth, accepted, len(requests))  # fmt: skip
            ended = next((j for j in range(len(tokens)) if first + (path[j] if path else j) in dead), None)  # fmt: skip
            if ended is not None:
                tokens = tokens[:ended]
            out.append(Verified(tokens, [None] * len(tokens), accepted, ended is not None, path))
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
                rows.append(pos[first + (v.rows[j] if v.rows else j)])
                tokens.append(t)
                tops.append(req.params.logprobs or 0)
                where.append((v, j))
        if not rows:
            return
        lp = torch.log_softmax(raw[torch.tensor(rows)], -1)
        for (v, j), entry in zip(where, logprob_entries(lp, tokens, tops), strict=True):
            v.logprobs[j] = entry

    def _compact(self, req: Request, path: list[int]) -> None:
        """Move the accepted path's KV (and its hidden-state rows, when kept) to the positions
        the tokens will have: a tree step wrote node ``i`` at ``computed + i``."""
        runner = self.runner
        if runner is None or path == list(range(len(path))):
            return
        compact_path_kv(runner.layers, req.block_ids, runner.block_size, req.num_computed_tokens, path)  # fmt: skip
        first = runner.tree_rows.get(req.request_id)
        feats = getattr(runner, "captured_hidden", None)
        if feats is not None and first is not None:
            idx = torch.tensor(path, device=feats.device) + first
            feats[first : first + len(path)] = feats[idx]

    def take_step_stats(self) -> SpecDecodingStats | None:
        """The verifications since the previous call (None: none)."""
        stats, self.step_stats = self.step_stats, None
        return stats

    def _record(self, request_id: str, k: int, accepted: int, batch: int) -> None:
        self.stats.add(k, accepted)
        if self.step_stats is None:
            self.step_stats = SpecDecodingStats(
                num_accepted_tokens_per_pos=[0] * self.config.num_speculative_tokens
            )
        self.step_stats.add(k, accepted)
        self.adaptive.record(request_id, k, accepted, batch)
