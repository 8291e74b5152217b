"""What ``LLM.generate`` returns (vLLM-compatible shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", or None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
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
    # vLLM's fields for features llmhal does not have: no prompt log-probabilities (not offered),
    # no prefix cache (nothing is ever reused), no encoder-decoder models.
    prompt_logprobs: None = None
    num_cached_tokens: int = 0
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
