"""``POST /rerank`` (also ``/v1/rerank`` and ``/v2/rerank``: the Jina / Cohere shape vLLM serves)
and ``POST /classify``.

Reranking scores each document against the query the way ``/score`` does on an embedding model
(vLLM's bi-encoder path): the cosine similarity of the two pooled embeddings. Results come best
first, ``top_n`` of them (0 or absent: all), each with its index in ``documents`` and, unless
``return_documents`` is false, the document's text. ``/classify`` needs a classification head
(a ``*ForSequenceClassification`` checkpoint), which none of llmhal's models has: it answers a 400
that says so and what to use instead, never numbers from a head that is not there.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from llmhal.entrypoints.api_models import OpenAIBaseModel
from llmhal.entrypoints.pooling_api import _body, _Prompted, truncated
from llmhal.pooling.offline import cosine
from llmhal.pooling.params import PoolingParams


class RerankRequest(_Prompted):
    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]] = Field(min_length=1)
    top_n: int | None = Field(None, ge=0, description="the best N (0 or absent: all)")
    return_documents: bool = True


class ClassificationRequest(_Prompted):
    """vLLM's request (answered with a 400 here: see the module's docstring)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]


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
    from llmhal.entrypoints.api_server import _GEN_DOCS, ApiError

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

    @app.post("/classify", openapi_extra=_body(ClassificationRequest), responses=_GEN_DOCS)
    async def classify(request: Request) -> JSONResponse:
        await parse(request, ClassificationRequest)  # a malformed body is still its own 400
        arch = ", ".join(getattr(state.llm.engine.config.model.hf_config, "architectures", None) or ["?"])  # fmt: skip
        raise ApiError(
            400,
            f"/classify needs a sequence-classification model (a *ForSequenceClassification "
            f"checkpoint with a classifier head); this server's model is {arch}, which has none, "
            "and llmhal runs no classifier heads. Compare texts with /score or /rerank, or pool "
            "them with /v1/embeddings",
        )
