"""``POST /v1/embeddings`` (OpenAI's shape), ``POST /pooling`` and ``POST /score`` (vLLM's),
and through :mod:`llmhal.entrypoints.rerank_api` ``/rerank`` and ``/classify``.

Each request's prompts go through the server's engine loop as pooling requests (see
:mod:`llmhal.pooling`), batched with whatever else is running. ``encoding_format="base64"`` sends
each vector as the base64 of its float32 little-endian bytes (what the ``openai`` SDK asks for by
default and decodes itself). vLLM's extras: ``truncate_prompt_tokens`` keeps each prompt's last N
tokens (-1: the model's context), and ``messages`` instead of ``input`` (embeddings and pooling)
pools a chat rendered by the model's template, without a generation prompt or special tokens
unless asked. Imported by the server only; :func:`add_pooling_routes` is called from its app
factory.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError

from llmhal.engine.engine_loop import FINISHED, EngineStopped
from llmhal.entrypoints.api_models import OpenAIBaseModel
from llmhal.pooling.offline import cosine, pair_up
from llmhal.pooling.params import PoolingParams

Input = str | list[str] | list[int] | list[list[int]]


class _Prompted(OpenAIBaseModel):
    """vLLM's prompt extras on every pooling route."""

    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="keep the last N tokens; -1: the context")  # fmt: skip
    add_special_tokens: bool | None = Field(None, description="default: true for input, false for messages")  # fmt: skip


class _Chat(_Prompted):
    """``input``, or vLLM's chat form: ``messages`` rendered by the model's chat template."""

    input: Input | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingRequest(_Chat):
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="Matryoshka models only")
    user: str | None = Field(None, description="accepted, ignored")
    normalize: bool | None = Field(None, description="vLLM's extra: the pooler_config's default")


class PoolingRequest(_Chat):
    model: str | None = None
    task: Literal["embed", "token_embed"] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    normalize: bool | None = None


class ScoreRequest(_Prompted):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int | None = 0


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class PoolingData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | list[list[float]] | str


class PoolingResponse(EmbeddingResponse):
    data: list[PoolingData]  # type: ignore[assignment]


class IOProcessorAnswer(OpenAIBaseModel):
    """/pooling's answer for a request with ``data`` (an IO processor's)."""

    request_id: str | None = None
    created_at: int
    data: Any


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(EmbeddingResponse):
    data: list[ScoreData]  # type: ignore[assignment]


def _prompts(value: Input) -> list[Any]:
    """OpenAI's ``input``: a string, strings, token ids, or lists of token ids."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise ValueError("input is empty; send a string, a list of strings or of token ids")
    if all(isinstance(v, int) for v in value):
        return [{"prompt_token_ids": value}]
    return [v if isinstance(v, str) else {"prompt_token_ids": v} for v in value]


def truncated(state: Any, prompts: list[Any], req: _Prompted, special: bool = True) -> list[Any]:
    """The prompts as the engine takes them, each cut to its last ``truncate_prompt_tokens``
    tokens when asked (vLLM's rule: -1 is the model's context, more than it is refused)."""
    from llmhal.entrypoints import api_completions as gen

    keep = req.truncate_prompt_tokens
    if req.add_special_tokens is not None:
        special = req.add_special_tokens
    if keep is None and special:
        return prompts  # the engine tokenizes text with its special tokens
    if keep is not None and keep > state.max_model_len:
        raise ValueError(f"truncate_prompt_tokens={keep} is more than the model's context of {state.max_model_len} tokens (max_model_len)")  # fmt: skip
    out = []
    for p in prompts:
        ids = gen._tokens(state, p, special, keep) if isinstance(p, str) else p["prompt_token_ids"]
        out.append({"prompt_token_ids": gen._truncate(ids, keep, state.max_model_len)})
    return out


def chat_or_input(state: Any, req: _Chat) -> list[Any]:
    """The request's prompts: its ``input``, or its ``messages`` rendered as one prompt."""
    if (req.input is None) == (req.messages is None):
        raise ValueError("send input (text or token ids) or messages (a chat), one of the two")
    if req.input is not None:
        return truncated(state, _prompts(req.input), req)
    text = state.llm.apply_chat_template(
        req.messages, req.add_generation_prompt, continue_final_message=req.continue_final_message,
        chat_template_kwargs=req.chat_template_kwargs,
    )  # fmt: skip
    # The template wrote the special tokens it wants (vLLM's default for chat: none added).
    return truncated(state, [text], req, special=False)


def _body(model: type[OpenAIBaseModel]) -> dict[str, Any]:
    """The request body's schema, inline, for /openapi.json (the routes read the JSON themselves,
    to answer errors in OpenAI's shape)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _encode(data: Any, fmt: str) -> Any:
    if fmt == "base64":
        return base64.b64encode(data.float().contiguous().numpy().astype("<f4").tobytes()).decode()  # fmt: skip
    return data.tolist()


def add_pooling_routes(app: FastAPI, state: Any) -> None:
    """Register the pooling routes on the server's app (``state``: its ServerState)."""
    from llmhal.entrypoints import api_completions as gen
    from llmhal.entrypoints.api_server import _GEN_DOCS, ApiError, _check_model, read_json

    async def parse(request: Request, model: type[OpenAIBaseModel], body: Any = None) -> Any:
        if body is None:
            body = await read_json(request, state.max_request_bytes)
            _check_model(state, body)
        try:
            return model.model_validate(body)
        except ValidationError as e:
            raise ApiError(400, str(e.errors(include_url=False)[:3])) from None

    async def pool(prompts: list[Any], params: PoolingParams) -> list[Any]:
        """Every prompt's PoolingRequestOutput, in order (400 for a prompt the engine refuses)."""
        loop = asyncio.get_running_loop()
        sink = gen.Sink(loop)
        work = [(p, params) for p in prompts]
        try:
            await loop.run_in_executor(state.workers, state.loop.submit, work, sink)
        except EngineStopped as e:
            raise ApiError(503, str(e)) from None
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e)) from None
        results: list[Any] = [None] * len(prompts)
        state.in_flight += 1
        try:
            while (item := await sink.q.get()) is not FINISHED:
                if isinstance(item, EngineStopped):
                    raise ApiError(503, f"{item}; the request was ended unfinished")
                if isinstance(item, Exception):
                    raise ApiError(500, f"pooling failed: {item}")
                index, out = item
                results[index] = out
        finally:
            state.in_flight -= 1
        return results

    def envelope(prefix: str, outs: list[Any], data: list[Any]) -> dict[str, Any]:
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": state.model_name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }

    def checked(fn: Any) -> Any:
        try:
            return fn()
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    async def prompts_of(fn: Any) -> list[Any]:
        """``fn()``'s prompts, made on a worker (templates and tokenizers stay off the event
        loop); 400 for what it refuses."""
        return await asyncio.get_running_loop().run_in_executor(state.workers, checked, fn)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, openapi_extra=_body(EmbeddingRequest), responses=_GEN_DOCS)  # fmt: skip
    async def embeddings(request: Request) -> JSONResponse:
        req = await parse(request, EmbeddingRequest)
        prompts = await prompts_of(lambda: chat_or_input(state, req))
        params = checked(lambda: PoolingParams("embed", req.dimensions, req.normalize))
        outs = await pool(prompts, params)
        data = [
            {
                "index": i,
                "object": "embedding",
                "embedding": _encode(o.outputs.data, req.encoding_format),
            }  # fmt: skip
            for i, o in enumerate(outs)
        ]
        return JSONResponse(envelope("embd", outs, data))

    @app.post("/pooling", response_model=PoolingResponse | IOProcessorAnswer, openapi_extra=_body(PoolingRequest), responses=_GEN_DOCS)  # fmt: skip
    async def pooling(request: Request) -> JSONResponse:
        body = await read_json(request, state.max_request_bytes)
        _check_model(state, body)
        if "data" in body:
            return await through_processor(body, request.headers.get("x-request-id"))
        req = await parse(request, PoolingRequest, body)
        dims = (req.model_extra or {}).get("dimensions")
        if dims is not None:  # vLLM refuses it here too
            raise ApiError(400, f"dimensions={dims} is for POST /v1/embeddings; /pooling returns the pooled hidden states whole", "dimensions")  # fmt: skip
        prompts = await prompts_of(lambda: chat_or_input(state, req))
        config = state.llm.engine.pooler_config
        task = req.task or ("token_embed" if config is not None and config.pooling_type == "ALL" else "embed")  # fmt: skip
        params = checked(lambda: PoolingParams(task, None, req.normalize))
        outs = await pool(prompts, params)
        data = [
            {
                "index": i,
                "object": "pooling",
                "data": _encode(o.outputs.data, req.encoding_format),
            }  # fmt: skip
            for i, o in enumerate(outs)
        ]
        return JSONResponse(envelope("pool", outs, data))

    async def through_processor(body: dict[str, Any], rid: str | None) -> JSONResponse:
        """vLLM's /pooling with ``data``: the server's IO processor makes the prompts and the
        answer ``{request_id, created_at, data}``."""
        from llmhal.pooling.io_processor import run_io_processor

        proc = getattr(state.llm, "io_processor", None)
        if proc is None:
            raise ApiError(400, "a /pooling request with 'data' goes through an IO processor, and none is loaded; start the server with --io-processor-plugin NAME (e.g. similarity_ranking)", "data")  # fmt: skip
        rid = rid or f"pool-{uuid.uuid4().hex}"
        try:
            out, _ = await run_io_processor(proc, body, pool, rid)
            resp = proc.output_to_response(out)
        except ApiError:
            raise
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e), "data") from None
        except Exception as e:  # a plugin's own failure: say whose
            raise ApiError(500, f"the IO processor {type(proc).__name__} failed: {type(e).__name__}: {e}") from None  # fmt: skip
        return JSONResponse({"request_id": resp.request_id or rid, "created_at": resp.created_at, "data": resp.data})  # fmt: skip

    async def score(request: Request) -> JSONResponse:
        req = await parse(request, ScoreRequest)
        left, right = checked(lambda: pair_up(req.text_1, req.text_2))
        outs = await pool(await prompts_of(lambda: truncated(state, left + right, req)), PoolingParams("embed"))  # fmt: skip
        n = len(left)
        data = [
            {"index": i, "object": "score", "score": cosine(a, b)}
            for i, (a, b) in enumerate(zip(outs[:n], outs[n:], strict=True))
        ]
        return JSONResponse(envelope("score", outs, data))

    for path in ("/score", "/v1/score"):
        app.post(path, response_model=ScoreResponse, openapi_extra=_body(ScoreRequest), responses=_GEN_DOCS)(score)  # fmt: skip

    from llmhal.entrypoints.rerank_api import add_rerank_routes

    add_rerank_routes(app, state, parse, pool, checked, prompts_of)
