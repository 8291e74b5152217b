"""Sampling parameters (vLLM-compatible names and meanings)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from numbers import Integral, Real

from llmhal.structured_output.params import StructuredOutputsParams

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): logits / 1e-40 overflow to inf,
# and the softmax of a row of infs is NaN, which failed every request in the batch.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature: 0 means greedy (as does anything below 1e-5, as in vLLM: dividing by it overflows);
        otherwise logits are divided by it before sampling.
    top_p / top_k / min_p: nucleus, top-k (0 or -1 = off) and min-p (relative to the top token) filters.
    max_tokens: new tokens to generate at most (None: up to the model's context length).
    stop: strings that end generation (excluded from the text unless include_stop_str_in_output).
    stop_token_ids: token ids that end generation (in addition to the model's EOS unless ignore_eos).
    seed: per-request seed; the same seed and prompt give the same tokens.
    logprobs: how many top log-probabilities to return per generated token (None: none; the sampled
        token's own log-probability is always included when this is set). They are the model's own
        (before penalties, temperature and filters), as vLLM returns by default.
    prompt_logprobs: the same for each prompt token, given the tokens before it (None: none). The
        output's ``prompt_logprobs`` has one entry per prompt token, None for the first (nothing
        predicts it), as in vLLM.
    n: how many completions of the prompt to return (each sampled on its own; with a seed, the
        i-th uses seed + i, as vLLM does). The server takes n too.
    repetition_penalty: > 1 discourages every token already in the prompt or the output (a positive
        logit is divided by it, a negative one multiplied; HF's and vLLM's rule); 1 = off.
    presence_penalty / frequency_penalty: subtracted from the logit of each token already generated,
        once / once per occurrence (OpenAI's rule, in [-2, 2]); 0 = off.
    logit_bias: token id -> a number in [-100, 100] added to that token's logit before sampling
        (OpenAI's ``logit_bias``; the server clamps larger ones into that range, as vLLM does).
    allowed_token_ids: only these tokens can be sampled (vLLM's; every other logit is -inf).
    Like penalties, neither changes the returned log-probabilities, which are the model's own.
    bad_words: words (or phrases) never to generate (vLLM's): each is tokenized as written and
        with a leading space, and the token that would complete either sequence is banned.
    structured_outputs: a :class:`~llmhal.structured_output.StructuredOutputsParams` (or a dict of
        its fields): the output follows a JSON schema, a regex, a choice or a grammar, and ends
        when it is complete. As in vLLM, the returned log-probabilities are those of the
        constrained distribution (tokens the constraint rules out are -inf).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, list | tuple):
            self.stop = list(self.stop)
        else:
            raise _bad(f"stop must be a string or a list of strings, got {self.stop!r}")
        if isinstance(self.stop_token_ids, str | bytes) or not isinstance(
            self.stop_token_ids, list | tuple | None
        ):
            raise _bad(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif not isinstance(self.structured_outputs, StructuredOutputsParams | None):
            raise _bad(
                "structured_outputs must be a StructuredOutputsParams (or a dict of its fields), "
                f"got {self.structured_outputs!r}"
            )
        self._check_types()
        self._check_token_maps()
        self._validate()

    def _check_token_maps(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _bad(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            for t, b in self.logit_bias.items():
                if not _is_int(t):
                    raise _bad(f"logit_bias keys must be token ids (integers), got {t!r}")
                if isinstance(b, bool) or not isinstance(b, Real) or not finite(b):
                    raise _bad(f"logit_bias values must be finite numbers, got {b!r} for {t}")
                if not -100 <= b <= 100:  # OpenAI's range; a float32 logit stays finite
                    raise _bad(f"logit_bias values must be in [-100, 100], got {b} for {t}")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None
        if self.bad_words is not None:
            words = self.bad_words
            if isinstance(words, str) or not isinstance(words, list | tuple):
                raise _bad(f"bad_words must be a list of strings, got {words!r}")
            if not all(isinstance(w, str) and w.strip() for w in words):
                raise _bad(f"bad_words must be non-empty strings, got {words!r}")
            self.bad_words = list(words) or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, str | bytes) or not isinstance(ids, list | tuple) or not ids:
                raise _bad(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}")
            if not all(_is_int(t) for t in ids):
                raise _bad(f"allowed_token_ids must be token ids (integers), got {ids!r}")
            self.allowed_token_ids = [int(t) for t in ids]

    def _check_types(self) -> None:
        """Types and finiteness first: a NaN temperature or a string seed would otherwise pass the
        range checks below and fail inside a batch, taking its batch-mates down with it."""
        for name in (
            "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty",
        ):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real):
                raise _bad(f"{name} must be a number, got {value!r}")
            if not finite(value):
                raise _bad(f"{name} must be finite, got {value!r}")
        for name in (
            "top_k", "min_tokens", "n", "max_tokens", "seed", "logprobs", "prompt_logprobs"
        ):  # fmt: skip
            value = getattr(self, name)
            optional = name in ("max_tokens", "seed", "logprobs", "prompt_logprobs")
            if (value is None and optional) or _is_int(value):
                continue
            raise _bad(f"{name} must be an integer{' or None' if optional else ''}, got {value!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise _bad(f"seed must fit in 64 bits, got {self.seed}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not all(isinstance(s, str) for s in self.stop):  # type: ignore[union-attr]
            raise _bad(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise _bad(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")

    def _validate(self) -> None:
        if self.n < 1:
            raise _bad(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise _bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise _bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise _bad(f"top_k must be -1 or 0 (off) or a positive count, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise _bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise _bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise _bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise _bad(f"{name} must be >= 0, got {getattr(self, name)}")
        if any(not s for s in self.stop):  # type: ignore[union-attr]
            raise _bad("stop strings must be non-empty")
        if self.repetition_penalty <= 0:
            raise _bad(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise _bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    def child(self, index: int) -> SamplingParams:
        """The parameters of the ``index``-th of ``n`` completions: n=1, seed + index."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)

    def children(self) -> list[SamplingParams]:
        """One request's parameters per completion (vLLM's parallel sampling): ``[self]`` when
        n=1, else :meth:`child` 0..n-1."""
        return [self.child(i) for i in range(self.n)] if self.n > 1 else [self]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def shaped(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad_words change the logits before sampling."""
        return (
            self.logit_bias is not None
            or self.allowed_token_ids is not None
            or self.bad_words is not None
        )

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def finite(x: Real) -> bool:
    """Whether ``x`` is a finite float (an int too large for one, 10**400, is not)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _is_int(x: object) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _bad(what: str) -> ValueError:
    return ValueError(f"Invalid SamplingParams: {what}")
