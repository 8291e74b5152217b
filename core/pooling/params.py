"""What a pooling request asks for, and the engine's defaults (vLLM's ``PoolerConfig`` and
``PoolingParams``, the fields llmhal implements).

Tasks (vLLM's names): ``embed`` pools each prompt into one vector (``pooling_type`` LAST, MEAN or
CLS; LAST by default, as vLLM pools a decoder), ``token_embed`` returns one vector per prompt token
(ALL). ``normalize`` (default on) scales each vector to unit L2 norm; ``dimensions`` keeps the first
``dimensions`` components first (Matryoshka truncation), allowed only where the model's config says
it was trained for it (``matryoshka_dimensions`` or ``is_matryoshka``), as in vLLM. ``classify``
runs a sequence classifier's head (``*ForSequenceClassification`` checkpoints, see
:mod:`llmhal.models.seq_cls`) on the last prompt position, as transformers does, and gives the class
probabilities.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
TASKS = ("embed", "token_embed", "classify")
# vLLM's tasks that need a head llmhal's models do not have (a cross-encoder, a reward model).
HEAD_TASKS = ("score", "token_classify")


@dataclass(frozen=True)
class PoolerConfig:
    """The engine's pooling defaults: ``LLM(pooler_config=...)``, ``--pooler-config '{json}'``."""

    pooling_type: str = "LAST"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        kind = str(self.pooling_type).upper()
        if kind not in POOLING_TYPES:
            raise ValueError(
                f"pooler_config pooling_type={self.pooling_type!r} is not one llmhal pools by; "
                f"use one of {', '.join(POOLING_TYPES)}"
            )
        object.__setattr__(self, "pooling_type", kind)
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config normalize must be true or false, got {self.normalize!r}")  # fmt: skip
        _check_dimensions(self.dimensions, "pooler_config")

    @classmethod
    def parse(cls, value: PoolerConfig | dict[str, Any] | str | None) -> PoolerConfig:
        """A PoolerConfig from itself, a dict, a JSON string (the CLI's), or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"--pooler-config takes a JSON object, got {value!r}: {e}") from None  # fmt: skip
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config takes a dict or PoolerConfig, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"pooler_config field(s) {', '.join(unknown)} are not supported by llmhal; it "
                f"takes {', '.join(sorted(known))}"
            )
        return cls(**value)


@dataclass(frozen=True)
class PoolingParams:
    """One pooling request's settings; None fields take the engine's :class:`PoolerConfig`."""

    task: str | None = None
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in TASKS:
            if self.task in HEAD_TASKS:
                raise ValueError(
                    f"pooling task {self.task!r} needs a head llmhal's models do not have (a "
                    f"cross-encoder's or a token classifier's); llmhal pools with "
                    f"{', '.join(TASKS)} (LLM.score compares embeddings)"
                )
            raise ValueError(f"pooling task {self.task!r} is unknown; use one of {', '.join(TASKS)}")  # fmt: skip
        _check_dimensions(self.dimensions, "PoolingParams")

    def resolve(self, config: PoolerConfig, hf_config: Any, hidden_size: int) -> ResolvedPooling:
        """The settings a request runs with: this request's, else the engine's; ValueError for
        a combination the model cannot give."""
        task = self.task or "embed"
        if task == "classify":  # the head reads the last position, unnormalized
            if self.dimensions is not None:
                raise ValueError("dimensions is for embeddings; a classification has one probability per label")  # fmt: skip
            return ResolvedPooling(task, "LAST", False, None)
        kind = "ALL" if task == "token_embed" else config.pooling_type
        if task == "embed" and kind == "ALL":
            raise ValueError(
                "the engine pools ALL tokens (pooler_config pooling_type='ALL'), which gives one "
                "vector per token: ask for pooling_task='token_embed' (LLM.encode, POST /pooling) "
                "instead of an embedding"
            )
        dims = self.dimensions if self.dimensions is not None else config.dimensions
        if dims is not None:
            _check_matryoshka(dims, hf_config, hidden_size)
        normalize = config.normalize if self.normalize is None else self.normalize
        return ResolvedPooling(task, kind, bool(normalize), dims)


@dataclass(frozen=True)
class ResolvedPooling:
    """A request's pooling, every choice made (what the runner's PoolingState follows)."""

    task: str
    pooling_type: str
    normalize: bool
    dimensions: int | None

    @property
    def reuses_prefix(self) -> bool:
        """Whether the request may take cached KV blocks for its leading tokens: only LAST
        pooling, which needs the last position's hidden state alone (a cached position's hidden
        state is not kept, so MEAN, CLS and ALL compute every position)."""
        return self.pooling_type == "LAST"


def _check_dimensions(dims: Any, where: str) -> None:
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise ValueError(f"{where} dimensions must be a positive integer, got {dims!r}")


def _check_matryoshka(dims: int, hf_config: Any, hidden_size: int) -> None:
    """vLLM's rule: truncation only for a model trained for it (Matryoshka), to a size it lists
    when it lists any."""
    allowed = getattr(hf_config, "matryoshka_dimensions", None)
    if not allowed and not getattr(hf_config, "is_matryoshka", False):
        raise ValueError(
            f"dimensions={dims}: this model does not support Matryoshka truncation (its config "
            f"has no matryoshka_dimensions or is_matryoshka); leave dimensions out to get all "
            f"{hidden_size}"
        )
    if allowed and dims not in allowed:
        raise ValueError(
            f"dimensions={dims} is not one this model was trained for; use one of {sorted(allowed)}"
        )
    if dims > hidden_size:
        raise ValueError(f"dimensions={dims} is more than the model's hidden size {hidden_size}")
