"""What ``LLM.generate`` returns (vLLM-compatible shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability, as vLLM returns it: ``rank`` is its 1-based place in the
    vocabulary by probability, ``decoded_token`` its own text (special tokens included)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # Per generated token: the sampled token and the top `logprobs` ones, by token id.
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", or None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)
    # Per prompt token (None for the first), with SamplingParams(prompt_logprobs=k).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Prompt tokens found in the prefix cache when the request was first admitted.
    num_cached_tokens: int = 0
    # vLLM's fields for a feature llmhal does not have: encoder-decoder models.
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
