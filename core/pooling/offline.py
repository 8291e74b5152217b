"""``LLM.encode``/``embed``/``score``: pooling requests run to completion on the LLM's engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from llmhal.pooling.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from llmhal.pooling.params import PoolingParams


def _as_list(prompts: Any) -> list[Any]:
    return [prompts] if isinstance(prompts, str | dict) else list(prompts)


def _params_for(
    params: PoolingParams | Sequence[PoolingParams] | None, n: int, task: str
) -> list[PoolingParams]:
    if params is None or isinstance(params, PoolingParams):
        one = params or PoolingParams()
        if one.task not in (None, task):
            raise ValueError(f"pooling_params.task={one.task!r} conflicts with pooling_task={task!r}")  # fmt: skip
        return [PoolingParams(task, one.dimensions, one.normalize)] * n
    out = list(params)
    if len(out) != n:
        raise ValueError(f"got {len(out)} PoolingParams for {n} prompts")
    return [_params_for(p, 1, task)[0] for p in out]


def run(
    engine: Any, prompts: list[Any], params: list[PoolingParams], progress: Any = None
) -> list[PoolingRequestOutput]:
    """Pool every prompt (all validated before any is queued); outputs in prompt order. Other
    requests already on the engine keep running in the same steps."""
    prepared = [engine.prepare_request(p, pp) for p, pp in zip(prompts, params, strict=True)]
    rids = [engine.add_request(prep) for prep in prepared]
    mine = set(rids)
    final: dict[str, PoolingRequestOutput] = {}
    try:
        while len(final) < len(rids) and engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in mine:
                    final[out.request_id] = out
                    if progress is not None:
                        progress.update(1)
    except BaseException:
        for rid in rids:
            engine.abort_request(rid)
        raise
    finally:
        if progress is not None:
            progress.close()
    return [final[r] for r in rids]


def pair_up(data_1: Any, data_2: Any) -> tuple[list[Any], list[Any]]:
    """vLLM's score pairs: 1 with 1, 1 with N (the first replicated) or N with N."""
    left, right = _as_list(data_1), _as_list(data_2)
    if not left or not right:
        raise ValueError("score needs at least one text on each side")
    if len(left) == 1:
        left = left * len(right)
    elif len(left) != len(right):
        raise ValueError(
            f"score pairs 1 text with N, or N with N; got {len(left)} and {len(right)}"
        )
    return left, right


def cosine(a: PoolingRequestOutput, b: PoolingRequestOutput) -> float:
    """The cosine similarity of two pooled vectors (vLLM's bi-encoder score)."""
    import torch

    return float(torch.nn.functional.cosine_similarity(a.outputs.data, b.outputs.data, dim=0))


def encode(
    llm: Any,
    prompts: Any,
    pooling_params: Any = None,
    pooling_task: str | None = None,
    bar: Callable[[int], Any] | None = None,
) -> list[PoolingRequestOutput]:
    if isinstance(prompts, dict) and "data" in prompts:
        return _through_io_processor(llm, prompts)
    if pooling_task is None:
        raise ValueError(
            "LLM.encode needs pooling_task: 'embed' (one vector per prompt) or 'token_embed' "
            "(one per token), as in vLLM"
        )
    prompts = _as_list(prompts)
    params = _params_for(pooling_params, len(prompts), pooling_task)
    return run(llm.engine, prompts, params, bar(len(prompts)) if bar else None)


def _through_io_processor(llm: Any, request: dict[str, Any]) -> Any:
    """vLLM's offline form: ``LLM.encode({"data": ...})`` goes through the LLM's IO processor and
    returns its post_process value."""
    import asyncio

    from llmhal.pooling.io_processor import run_io_processor

    proc = getattr(llm, "io_processor", None)
    if proc is None:
        raise ValueError(
            "a prompt with 'data' goes through an IO processor, and this LLM has none; start it "
            "with LLM(io_processor_plugin=NAME) (e.g. 'similarity_ranking')"
        )

    async def pool(prompts: list[Any], params: PoolingParams) -> list[Any]:
        return run(llm.engine, prompts, [params] * len(prompts))

    return asyncio.run(run_io_processor(proc, request, pool))[0]


def embed(
    llm: Any, prompts: Any, pooling_params: Any = None, bar: Callable[[int], Any] | None = None
) -> list[EmbeddingRequestOutput]:
    outs = encode(llm, prompts, pooling_params, "embed", bar)
    return [EmbeddingRequestOutput.from_base(o) for o in outs]


def classify(
    llm: Any, prompts: Any, pooling_params: Any = None, bar: Callable[[int], Any] | None = None
) -> list[ClassificationRequestOutput]:
    """A sequence classifier's class probabilities for each prompt (vLLM's ``LLM.classify``)."""
    outs = encode(llm, prompts, pooling_params, "classify", bar)
    return [ClassificationRequestOutput.from_base(o) for o in outs]


def score(
    llm: Any,
    data_1: Any,
    data_2: Any,
    pooling_params: Any = None,
    bar: Callable[[int], Any] | None = None,
) -> list[ScoringRequestOutput]:
    """vLLM's bi-encoder scoring: the cosine similarity of the two texts' embeddings, pairing
    1 with 1, 1 with N (the first replicated) or N with N."""
    left, right = pair_up(data_1, data_2)
    embs = encode(llm, left + right, pooling_params, "embed", bar)
    n = len(left)
    outs = []
    for a, b in zip(embs[:n], embs[n:], strict=True):
        outs.append(
            ScoringRequestOutput(
                request_id=f"score-{a.request_id}-{b.request_id}",
                outputs=ScoringOutput(cosine(a, b)),
                prompt_token_ids=a.prompt_token_ids + b.prompt_token_ids,
                num_cached_tokens=a.num_cached_tokens + b.num_cached_tokens,
            )
        )
    return outs
