"""The structured-output contract: a backend compiles a request's constraint into a grammar, and
the grammar (one per request) says which tokens may come next.

Bitmasks are vLLM's and xgrammar's format: int32 rows of ``ceil(vocab / 32)`` words, bit ``t % 32``
of word ``t // 32`` set when token ``t`` is allowed; an all-ones row (-1) is "no constraint".

When the engine calls what:

* :meth:`StructuredOutputBackend.compile` when a request is submitted, on one of the manager's
  compile threads, once per distinct constraint (the result is cached; the request is refused,
  with the backend's reason, if its constraint does not compile), then
  :meth:`StructuredOutputBackend.grammar` once per request;
* :meth:`StructuredOutputGrammar.fill_bitmask` before each token of the request is sampled;
* :meth:`StructuredOutputGrammar.accept_tokens` with the sampled token; False means the grammar
  rejected it (only possible when another setting, e.g. ``min_tokens`` banning EOS, masked out
  every token the grammar allows), and the request ends;
* :meth:`StructuredOutputGrammar.is_terminated` after that: True once the grammar has accepted its
  stop token, which ends the request (``ignore_eos`` or not: the output is complete).

``validate_tokens`` and ``rollback`` are for callers that try tokens ahead (speculative decoding):
the engine's own decoding never takes a token back (a preempted request keeps its tokens).
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from llmhal.structured_output.params import StructuredOutputOptions


class StructuredOutputGrammar(ABC):
    """One request's constraint, with its position in the output so far."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: Sequence[int]) -> bool:
        """Advance over ``tokens``; False (and the state unspecified) if one is not allowed."""

    @abstractmethod
    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar would accept, without advancing."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Take back the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write row ``index`` of ``bitmask``: the tokens allowed next."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar has accepted its stop token (the output is complete)."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start (no tokens accepted)."""


class StructuredOutputBackend(ABC):
    """One per engine and backend name: compiles constraints for its tokenizer.

    ``tokenizer`` is the engine's HF tokenizer, ``vocab_size`` the model's logits width (it may
    exceed the tokenizer's vocabulary: padding rows are never allowed), ``stop_token_ids`` the
    tokens that end a completed output (the model's EOS ids).

    ``processes`` is set by the manager when it compiles off the engine's path (a
    :class:`~llmhal.structured_output.compile_pool.CompileProcesses`, else None): a backend whose
    library holds the GIL while it compiles does that part there, so decoding is not slowed.
    """

    name: str = ""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.processes: Any = None

    @abstractmethod
    def compile(
        self, request_type: StructuredOutputOptions, grammar_spec: str, *, compact: bool = False
    ) -> Any:
        """The constraint compiled, to be shared by every request that asks for it (the manager
        caches it by backend and spec, and calls this on its compile threads: it must not touch
        per-request state). ``compact``: JSON without optional whitespace. Raises ValueError,
        saying why, for a constraint this backend cannot compile or would not enforce."""

    @abstractmethod
    def grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh grammar for one request over what :meth:`compile` returned (cheap)."""

    def compile_grammar(
        self, request_type: StructuredOutputOptions, grammar_spec: str, *, compact: bool = False
    ) -> StructuredOutputGrammar:
        """:meth:`compile` then :meth:`grammar`, uncached."""
        return self.grammar(self.compile(request_type, grammar_spec, compact=compact))

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        return torch.full((max_num_seqs, bitmask_words(self.vocab_size)), -1, dtype=torch.int32)

    def destroy(self) -> None:
        """Release what the backend holds (compiled-grammar caches)."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


_BITS = torch.arange(32, dtype=torch.int32)
# For each byte value, what it adds to its 8 tokens' logits: 0 where the bit is set (allowed),
# -inf where it is clear (bit j of byte k of word w is token 32w + 8k + j on little-endian).
_BYTE_ADD = torch.where(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))  # fmt: skip


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, scratch: dict[Any, Any] | None = None
) -> None:
    """Set ``logits[i, t]`` to -inf, in place, where bit ``t`` of ``bitmask[i]`` is clear
    (``logits`` [rows, vocab], ``bitmask`` [rows, words]; a bitmask narrower than the logits
    allows nothing past it). The logits are finite or -inf, as the engine's are (logit_bias is
    bounded), so adding -inf is setting it. ``scratch``: a dict the caller keeps between calls
    (one thread at a time), holding the CPU path's buffers (sized for the largest batch seen)."""
    vocab = logits.shape[-1]
    if logits.device.type == "cpu" and sys.byteorder == "little":
        # One gather of 8 additions per mask byte, into buffers kept between steps, and one add:
        # on SmolLM2's 49152 tokens at batch 8, 0.16 ms (0.3 ms with cold caches) against
        # 1.8 ms for numpy's unpackbits then masked_fill, 5% of a batch-8 decode step; fresh
        # buffers each step cost twice as much (their pages are touched new).
        rows, nbytes = bitmask.shape[0], bitmask.shape[1] * 4
        size = rows * nbytes
        scratch = {} if scratch is None else scratch
        if scratch.get("index") is None or scratch["index"].numel() < size:  # grown, never shrunk
            scratch["index"], scratch["add"] = torch.empty(size, dtype=torch.int32), torch.empty(size, 8)  # fmt: skip
        index, add = scratch["index"][:size], scratch["add"][:size]
        index.copy_(bitmask.contiguous().view(torch.uint8).view(-1))
        torch.index_select(_BYTE_ADD, 0, index, out=add)
        width = nbytes * 8
        logits[:, : min(vocab, width)] += add.view(rows, width)[:, :vocab]
        if width < vocab:
            logits[:, width:] = float("-inf")
        return
    apply_token_bitmask_torch(logits, bitmask)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """:func:`apply_token_bitmask` in torch operations only (any device)."""
    vocab = logits.shape[-1]
    bits = _BITS.to(bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
    if allowed.shape[1] < vocab:
        pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool, device=allowed.device)  # fmt: skip
        allowed = torch.cat([allowed, pad], 1)
    logits.masked_fill_(~allowed, float("-inf"))
