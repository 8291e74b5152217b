"""The proposer contract: what a speculative-decoding method is given and what it returns.

After every engine step, the engine asks the configured proposer for draft tokens for each running
request that just got a token (prefill chunks and requests that cannot speculate are left out).
The drafts are verified in the next step: the target model runs the request's last token and its
drafts as one chunk (1 + k positions), and the rejection sampler
(:mod:`llmhal.spec_decode.rejection_sampler`) keeps the longest prefix the target agrees with, plus
one token of the target's own. A proposer never changes what is generated, only how fast:
greedy output is the non-speculative output token for token, sampled output keeps its distribution.

Lifetime, in order:

* ``check_config(config)`` (a classmethod): when the speculative config is read, before anything
  loads. Raise ``ValueError`` naming the key and the remedy for a value the method cannot use.
* ``__init__(config, engine_config)``: ``config`` is the :class:`SpeculativeConfig` (its ``extra``
  holds the keys the class declared in ``config_keys``), ``engine_config`` the target's
  :class:`llmhal.config.EngineConfig`; built after the target's config is read, before its weights
  load, so checks that need the target (its vocabulary, hidden size) belong here.
* ``load_model(target_model)``: once, after the target is loaded (a draft model or heads load here;
  methods without a model do nothing).
* ``propose(requests)``: after every step, with one :class:`DraftRequest` per request to draft for.
  Returns one list of draft token ids per request, at most ``max_draft`` long (longer lists are
  cut); an empty list means no draft for it this step. Called under ``torch.inference_mode``.
* ``finish(request_id)``: the request ended, was aborted or preempted; forget any state kept for it.

A method that drafts from the target's hidden states (EAGLE) sets ``uses_target_hidden_states``;
each :class:`DraftRequest` then carries ``hidden_states``: one row per position from
``hidden_start`` to the position before the newest token (the target computed each of them on a
committed token, in this step or earlier ones since the previous call for this request). A row is
the target's last hidden state, or the layer inputs the proposer asked the target for in
``load_model`` (``target_model.set_aux_hidden_state_layers``), concatenated. ``hidden_start`` is
where the previous call's rows ended, unless the target skipped or recomputed positions (a cached
prefix, a preemption): a proposer that keeps state per request starts over there.

``memory_bytes()`` says what the proposer holds (weights, its own KV cache) for load reports.
A proposer may return a :class:`llmhal.spec_decode.tree_verify.TreeDraft` (tokens and a tree's
shape) instead of a list: the tree is verified in one forward through ``tree_attn``. Such a proposer
sets ``drafts_trees`` (true), so the engine selects that backend before the target is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.spec_decode.config import SpeculativeConfig


@dataclass(frozen=True)
class DraftRequest:
    """One request to draft for: its committed tokens (the prompt, then the output so far; the
    engine's own lists, to be read and never changed) and how many drafts it may take now (never
    more than ``num_speculative_tokens``, the tokens left before ``max_tokens`` and the context's
    end). Committed tokens never change, only grow, so a proposer may keep per-request state
    between calls."""

    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    max_draft: int
    # The target's hidden states for positions hidden_start .. num_tokens - 2 ([rows, features]),
    # for proposers with uses_target_hidden_states (None for the others).
    hidden_states: Any = None
    hidden_start: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def hidden_reaches_newest(self) -> bool:
        """Whether ``hidden_states`` run up to the newest token's predecessor (the row a head
        drafts from); not so where the target skipped its positions or kept no rows."""
        rows = self.hidden_states
        return rows is not None and self.hidden_start + len(rows) == self.num_tokens - 1


class Proposer:
    """Base class of speculative-decoding proposers (see the module docstring)."""

    # Keys of the speculative config this method reads beyond the common ones (vLLM's names).
    config_keys: ClassVar[frozenset[str]] = frozenset()
    # Whether propose() needs the target's hidden states (DraftRequest.hidden_states).
    uses_target_hidden_states: ClassVar[bool] = False

    def __init__(self, config: SpeculativeConfig, engine_config: Any) -> None:
        self.config = config
        self.engine_config = engine_config

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        """Refuse settings this method cannot use (nothing by default)."""

    def load_model(self, target_model: Any) -> None:
        """Load what the method needs beside the target (nothing by default)."""

    def memory_bytes(self) -> int:
        return 0

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        raise NotImplementedError(f"{type(self).__name__} does not implement propose()")

    def finish(self, request_id: str) -> None:
        """Forget ``request_id`` (nothing kept by default)."""
