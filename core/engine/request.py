"""A request's state as it moves through the engine."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmhal.engine.detokenizer import IncrementalDetokenizer
from llmhal.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from llmhal.engine.sampling_params import SamplingParams


class TokenView(Sequence):
    """Several token lists read as one, without copying them (a reasoning parser asked about every
    new token would otherwise copy the whole sequence each time)."""

    def __init__(self, *parts: Sequence[int]) -> None:
        self.parts = parts

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(self)[i]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        for p in self.parts:
            if i < len(p):
                return p[i]
            i -= len(p)
        raise IndexError(i)

    def __iter__(self) -> Any:
        for p in self.parts:
            yield from p

    def __reversed__(self) -> Any:
        for p in reversed(self.parts):
            yield from reversed(p)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_FSM = "waiting_for_fsm"  # its structured-output constraint is compiling
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass(eq=False)
class Request:
    """``num_computed_tokens`` counts tokens whose KV is in the cache; the engine computes the rest.

    After preemption it drops to 0 and the prompt plus the tokens generated so far are recomputed
    (less what the prefix cache still holds), so a preempted request continues exactly where it
    stopped.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    generator: Any = None  # torch.Generator when seeded
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    # One per prompt token computed so far (the first None), when prompt_logprobs was asked for;
    # a preempted request's recomputed prompt adds nothing twice (see ModelRunner.execute).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float = 0.0
    # The request's StructuredOutputGrammar, when its params ask for structured outputs.
    grammar: Any = None
    # With a grammar and the engine's reasoning gate: whether the reasoning has ended (the grammar
    # applies only then); None without the gate.
    reasoning_ended: bool | None = None
    # params.bad_words as token sequences (LLMEngine.bad_words_token_ids).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    # Prefix caching (KVCacheManager): vLLM's cache_salt, the hashes of the full blocks of tokens
    # so far (computed on demand), how many leading blocks are registered in the cache, and the
    # prompt tokens found cached when the request was first admitted (None: not yet admitted).
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int | None = None
    # Speculative decoding: draft tokens to verify in the request's next step (after its last
    # token); the scheduler trims them to what fits, preemption drops them.
    spec_token_ids: list[int] = field(default_factory=list)
    # A pooling request's llmhal.pooling.pooler.PoolingState: prefilled only, never sampled.
    pooling: Any = None
    # The scheduler's order under its priority policy: priority (lower first), then arrival.
    priority: int = 0
    arrival_index: int = 0
    _emitted_chars: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    def to_output(self, hold_back: int = 0) -> RequestOutput:
        """The output so far; while running, the last ``hold_back`` characters (a possible partial
        stop string) are not shown yet."""
        finished = self.status.finished
        text = self.detokenizer.text
        if not finished and hold_back:
            text = text[: max(self._emitted_chars, len(text) - hold_back)]
        self._emitted_chars = len(text)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.status.value if finished else None,  # vLLM's "abort" too
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            self.request_id,
            self.prompt,
            list(self.prompt_token_ids),
            [completion],
            finished,
            self.metrics,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            num_cached_tokens=self.num_cached_tokens or 0,
        )
