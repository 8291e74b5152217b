"""``POST /rerank`` (also ``/v1/rerank`` and ``/v2/rerank``: the Jina / Cohere shape vLLM serves)
and ``POST /classify``.

Reranking scores each document against the query the way ``/score`` does on an embedding model
(vLLM's bi-encoder path): the cosine similarity of the two pooled embeddings. Results come best
first, ``top_n`` of them (0 or absent: all), each with its index in ``documents`` and, unless
``return_documents`` is false, the document's text. ``/classify`` (vLLM's shape) runs a sequence
classifier's head (a ``*ForSequenceClassification`` checkpoint, :mod:`llmhal.models.seq_cls`) and
answers each input's label and class probabilities; on any other model it is a 400 that says so
and what to use instead, never numbers from a head that is not there.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from llmhal.entrypoints.api_models import OpenAIBaseModel
from llmhal.entrypoints.pooling_api import _body, _Prompted, _prompts, truncated
from llmhal.pooling.offline import cosine
from llmhal.pooling.params import PoolingParams


class RerankRequest(_Prompted):
    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]] = Field(min_length=1)
    top_n: int | None = Field(None, ge=0, description="the best N (0 or absent: all)")
    return_documents: bool = True


class ClassificationRequest(_Prompted):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: dict[str, int]


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def _text(doc: str | dict[str, Any], i: int) -> str:
    """A document: a string, or Cohere's ``{"text": ...}``."""
    if isinstance(doc, str):
        return doc
    if isinstance(doc.get("text"), str):
        return doc["text"]
    raise ValueError(f"documents[{i}] must be a string or {{'text': string}}; llmhal reranks text")


def add_rerank_routes(app: FastAPI, state: Any, parse: Any, pool: Any, checked: Any, prompts_of: Any) -> None:  # fmt: skip
    """Register /rerank and /classify; ``parse``, ``pool``, ``checked`` and ``prompts_of`` are
    the pooling routes' own (see :func:`llmhal.entrypoints.pooling_api.add_pooling_routes`)."""
    from llmhal.entrypoints.api_server import _GEN_DOCS

    async def rerank(request: Request) -> JSONResponse:
        req = await parse(request, RerankRequest)
        docs = checked(lambda: [_text(d, i) for i, d in enumerate(req.documents)])
        prompts = await prompts_of(lambda: truncated(state, [req.query, *docs], req))
        outs = await pool(prompts, PoolingParams("embed"))
        query, rest = outs[0], outs[1:]
        scored = sorted(
            ((i, cosine(query, o)) for i, o in enumerate(rest)), key=lambda x: -x[1]
        )  # fmt: skip
        if req.top_n:
            scored = scored[: req.top_n]
        results = []
        for i, score in scored:
            item: dict[str, Any] = {"index": i, "relevance_score": score}
            if req.return_documents:
                item["document"] = {"text": docs[i]}
            results.append(item)
        # The query is pooled once, and counted once.
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        body = {"id": f"rerank-{uuid.uuid4().hex}", "model": state.model_name, "usage": {"total_tokens": tokens}, "results": results}  # fmt: skip
        return JSONResponse(body)

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path, response_model=RerankResponse, openapi_extra=_body(RerankRequest), responses=_GEN_DOCS)(rerank)  # fmt: skip

    @app.post("/classify", response_model=ClassificationResponse, openapi_extra=_body(ClassificationRequest), responses=_GEN_DOCS)  # fmt: skip
    async def classify(request: Request) -> JSONResponse:
        req = await parse(request, ClassificationRequest)
        prompts = await prompts_of(lambda: truncated(state, _prompts(req.input), req))
        outs = await pool(prompts, PoolingParams("classify"))  # a 400 on a model without a head
        labels = getattr(state.llm.engine.config.model.hf_config, "id2label", None) or {}
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data.tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            label = labels.get(best, labels.get(str(best)))
            data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        body = {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": state.model_name,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}  # fmt: skip
        return JSONResponse(body)
