"""What ``LLM.encode``/``embed``/``score`` return (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PoolingOutput:
    data: Any  # torch.Tensor: [hidden] pooled, or [tokens, hidden] for token_embed


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per label, summing to 1

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class PoolingRequestOutput:
    """One pooling request's result; ``outputs`` is a PoolingOutput, or an EmbeddingOutput /
    ScoringOutput in the subclasses below."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt: str | None = None


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        data = out.outputs.data
        if data.dim() != 1:
            raise ValueError(
                f"an embedding is one vector; this output has shape {tuple(data.shape)} "
                "(per-token pooling: use LLM.encode)"
            )
        return cls(
            out.request_id, EmbeddingOutput(data.tolist()), out.prompt_token_ids, out.finished,
            out.num_cached_tokens, out.prompt,
        )  # fmt: skip


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    pass


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(
            out.request_id, ClassificationOutput(out.outputs.data.tolist()), out.prompt_token_ids,
            out.finished, out.num_cached_tokens, out.prompt,
        )  # fmt: skip
