"""The FastAPI application behind ``llmhal serve``: routes, API keys, CORS, limits and errors.

Every error is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status as ``code``: a bad request is a 400 (never FastAPI's 422 body), an unknown route a 404, a
wrong method a JSON 405, a body over ``--max-request-bytes`` a 413 sent before the body is read,
a body that stalls a 408. With an API key, ``/v1/*`` needs ``Authorization: Bearer <key>``
(else 401) and the other routes stay open, as in vLLM. Imported only by the server (FastAPI is
the ``serve`` extra).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from llmhal.engine.engine_loop import EngineLoop, EngineStopped
from llmhal.entrypoints import api_completions as gen
from llmhal.entrypoints import api_models as m
from llmhal.entrypoints import openai_protocol as api
from llmhal.entrypoints import tokenization
from llmhal.entrypoints.metrics import CONTENT_TYPE, PrometheusStatLogger
from llmhal.logger import init_logger

logger = init_logger(__name__)

# A client that stops sending its body for this long gets a 408 and is dropped.
READ_TIMEOUT_S = 60.0
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
ROUTES = (
    "the routes are GET /health, /ping, /load, /v1/models, /metrics, /version, /openapi.json, "
    "/docs and POST /v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings, "
    "/pooling, /score, /rerank, /classify, /tokenize, /detokenize; GET, DELETE /v1/responses/{id}"
)
_PHRASES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found",
            405: "method_not_allowed", 408: "request_timeout", 413: "payload_too_large",
            500: "server_error", 503: "service_unavailable"}  # fmt: skip


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None, **headers: str) -> JSONResponse:  # fmt: skip
    kind = _PHRASES.get(status, "error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers or None)


class ServerState:
    """What every request shares: the engine loop, the served model's name and the settings."""

    def __init__(self, llm: Any, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        self.loop = EngineLoop(llm.engine)
        self.started = int(time.time())
        # The model's generation_config.json settings, for fields a request leaves out (vLLM).
        self.defaults = dict(llm.engine.config.extra.get("generation_defaults") or {})
        self.token_text = llm.engine.token_text  # OpenAI's `token` of a log-probability entry
        # GET /metrics: vLLM adds its Prometheus logger to the engine's; here it joins any plugins'.
        self.metrics = PrometheusStatLogger(llm.engine.config, model_name=model_name)
        llm.engine.stat_loggers.append(self.metrics)
        self.max_model_len = llm.engine.config.model.max_model_len
        # No token is longer than this many characters, so a prompt longer than the context
        # times it cannot fit, and is refused without being tokenized.
        longest = max((len(t) for t in llm.get_tokenizer().get_vocab()), default=1)
        self.max_prompt_chars = self.max_model_len * max(longest, 1)
        self.tool_parser_cls: Any = None
        self.tool_parser_name = ""
        self.auto_tools = False
        self.reasoning_cls: Any = None
        self.prompt_tokens_details = False
        self.api_key: str | None = None
        self.max_request_bytes = DEFAULT_MAX_REQUEST_BYTES
        self.log_requests = True
        self.tokenizer_info = False
        self.trust_request_chat_template = False
        self.in_flight = 0  # GET /load
        # Preparing a request (templates, tokenizers, grammars) runs here, off the event loop.
        self.workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="llmhal-prepare")
        self._ignored: set[str] = set()
        self._ignored_lock = threading.Lock()

    def note_ignored(self, fields: set[str]) -> None:
        """Log each ignored field's name once (vLLM ignores what it does not know, and logs it)."""
        with self._ignored_lock:
            new = sorted(fields - self._ignored)
            self._ignored |= fields
        if new:
            logger.warning("Ignoring request field(s) llmhal does not use: %s", ", ".join(new))

    def prompt_text(self, out: Any) -> str:
        """An echoed prompt: as sent, or a token-id prompt's decoded text."""
        if out.prompt is not None:
            return out.prompt
        return self.llm.get_tokenizer().decode(out.prompt_token_ids)


class _Guard:
    """ASGI middleware: the API key on /v1/* and the request log."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state
        key = state.api_key
        self.digest = hashlib.sha256(key.encode()).digest() if key else None

    def _authorized(self, scope: dict[str, Any]) -> bool:
        path = scope["path"]
        root = scope.get("root_path") or ""
        if root and path.startswith(root):
            path = path[len(root) :]
        if self.digest is None or scope["method"] == "OPTIONS" or not path.startswith("/v1"):
            return True
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        given = hashlib.sha256(token.strip().encode()).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(given, self.digest)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            response = error_response(401, "Unauthorized: send the server's API key as 'Authorization: Bearer <key>'")  # fmt: skip
            return await response(scope, receive, send)
        status = [0]

        async def logged_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        await self.app(scope, receive, logged_send)
        if self.state.log_requests:
            client = scope.get("client") or ("-", 0)
            logger.info("%s:%s %s %s %d", client[0], client[1], scope["method"], scope["path"], status[0])  # fmt: skip


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object: 413 past ``limit`` bytes (before reading on when the length
    is declared), 408 when the client stalls, 400 when it is not a JSON object."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise ApiError(400, f"Content-Length must be a number of bytes, got {length!r}")
        if int(length) > limit:
            raise ApiError(413, f"the body is {length} bytes, over the server's limit of {limit} (--max-request-bytes)")  # fmt: skip
    chunks, size = [], 0
    while True:
        try:
            message = await asyncio.wait_for(request.receive(), READ_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the body did not arrive within {READ_TIMEOUT_S:g} s") from None
        if message["type"] == "http.disconnect":
            raise gen.ClientGone("the client closed the connection mid-body")
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            raise ApiError(413, f"the body is over the server's limit of {limit} bytes (--max-request-bytes)")  # fmt: skip
        if not message.get("more_body"):
            break
    try:
        body = json.loads(b"".join(chunks) or b"{}")
    except RecursionError:
        raise ApiError(400, "the JSON body is nested too deeply") from None
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _check_model(state: ServerState, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and model != state.model_name:
        # vLLM's answer: the model field must name the served model (or be left out).
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{state.model_name}` (GET /v1/models)", "model")  # fmt: skip


def _jsonable(value: Any, whole_tokens: bool = False) -> Any:
    """``value`` as JSON. An added token is its text (``eos_token`` and the like, which clients read
    as strings), or with ``whole_tokens`` its record as tokenizer_config.json writes it ({"content",
    "special", ...}) so a client can rebuild the table; str() gave Python's repr, which parses as
    nothing."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v, whole_tokens) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, whole_tokens) for v in value]
    if hasattr(value, "content") and hasattr(value, "__getstate__"):
        record = value.__getstate__()
        if isinstance(record, dict):
            return _jsonable(record) if whole_tokens else str(record.get("content", value))
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def _tokenizer_info(state: ServerState) -> dict[str, Any]:
    tok = state.llm.get_tokenizer()
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
    for key, value in getattr(tok, "init_kwargs", {}).items():
        if key.endswith("_file") or key in ("vocab", "merges"):
            continue
        info[key] = _jsonable(value, whole_tokens=key == "added_tokens_decoder")
    info["chat_template"] = getattr(tok, "chat_template", None)
    return info


_GEN_DOCS = {
    400: {"model": m.ErrorResponse}, 401: {"model": m.ErrorResponse},
    404: {"model": m.ErrorResponse}, 413: {"model": m.ErrorResponse},
    503: {"model": m.ErrorResponse},
}  # fmt: skip


def _body_doc(model: type) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def build_app(state: ServerState, allowed_origins: list[str] | None = None) -> FastAPI:
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.openapi.utils import get_openapi

    from llmhal import __version__

    app = FastAPI(title="llmhal", version=__version__)
    app.add_middleware(_Guard, state=state)
    # Added last, so outermost: a 401 carries the CORS headers too.
    app.add_middleware(
        CORSMiddleware, allow_origins=allowed_origins or ["*"], allow_methods=["*"],
        allow_headers=["*"],
    )  # fmt: skip

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        close = {"Connection": "close"} if e.status in (408, 413) else {}
        return error_response(e.status, e.message, e.param, **close)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 404:
            message = f"no route {request.url.path}; {ROUTES}"
        elif e.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}; {ROUTES}"
        else:
            message = str(e.detail)
        return error_response(e.status_code, message)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(400, str(e.errors()[:3]))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/ping")
    async def ping_post() -> dict[str, str]:  # SageMaker's health check
        return {"status": "ok"}

    @app.get("/load")
    async def load() -> dict[str, int]:
        return {"server_load": state.in_flight}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=m.ModelList)
    async def models() -> dict[str, Any]:
        card = m.ModelCard(
            id=state.model_name, created=state.started, root=state.llm.load_report.model_path,
            max_model_len=state.max_model_len,
        )  # fmt: skip
        return {"object": "list", "data": [card.model_dump()]}

    if state.tokenizer_info:

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> dict[str, Any]:
            return _tokenizer_info(state)

    async def tokens_route(request: Request, fn: Any) -> JSONResponse:
        body = await read_json(request, state.max_request_bytes)
        _check_model(state, body)
        loop = asyncio.get_running_loop()
        try:
            return JSONResponse(await loop.run_in_executor(state.workers, fn, body, state.llm))
        except (api.BadRequest, ValueError, TypeError) as e:
            raise ApiError(400, str(e)) from None
        except Exception as e:  # e.g. a chat template that raises
            raise ApiError(400, f"{request.url.path.rsplit('/', 1)[-1]} failed: {e}") from None

    @app.post("/tokenize", response_model=m.TokenizeResponse, openapi_extra=_body_doc(m.TokenizeRequest), responses=_GEN_DOCS)  # fmt: skip
    async def tokenize(request: Request) -> JSONResponse:
        return await tokens_route(request, lambda b, llm: tokenization.tokenize(b, llm, state.note_ignored))  # fmt: skip

    @app.post("/detokenize", response_model=m.DetokenizeResponse, openapi_extra=_body_doc(m.DetokenizeRequest), responses=_GEN_DOCS)  # fmt: skip
    async def detokenize(request: Request) -> JSONResponse:
        return await tokens_route(request, lambda b, llm: tokenization.detokenize(b, llm, state.note_ignored))  # fmt: skip

    async def generate(request: Request, chat: bool) -> Response:
        body = await read_json(request, state.max_request_bytes)
        _check_model(state, body)
        loop = asyncio.get_running_loop()
        sink = gen.Sink(loop)
        rid = request.headers.get("x-request-id")
        try:
            plan = await loop.run_in_executor(state.workers, gen.prepare, state, body, chat, sink, rid)  # fmt: skip
        except EngineStopped as e:
            raise ApiError(503, str(e)) from None
        except (api.BadRequest, ValueError, TypeError) as e:
            raise ApiError(400, str(e)) from None
        except Exception as e:  # never leave the client without an answer
            logger.exception("Could not queue a request")
            raise ApiError(500, f"could not queue the request: {e}") from None
        if body.get("stream"):
            return _EventStream(state, plan)
        return await _complete(state, plan, request.receive)

    async def _complete(state: ServerState, plan: gen.Plan, receive: Any) -> Response:
        last: list[Any] = [None] * plan.size
        gone = asyncio.ensure_future(gen.wait_disconnect(receive))
        state.in_flight += 1
        try:
            async for index, out in gen.updates(plan, gone):
                last[index] = out
        except gen.ClientGone:
            _abort(state, plan)
            return Response(status_code=499)  # nobody reads it
        except EngineStopped as e:
            return error_response(503, f"{e}; the request was ended unfinished")
        except Exception as e:
            return error_response(500, f"generation failed: {e}")
        finally:
            gone.cancel()
            state.in_flight -= 1
        try:  # a parser plugin may fail on this text
            return JSONResponse(gen.full_body(state, plan, last))
        except Exception as e:
            logger.exception("Could not read the answer's reasoning or tool calls")
            return error_response(500, f"reading the answer failed: {e}")

    @app.post("/v1/completions", response_model=m.CompletionResponse, openapi_extra=_body_doc(m.CompletionRequest), responses=_stream_docs())  # fmt: skip
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions", response_model=m.ChatCompletionResponse, openapi_extra=_body_doc(m.ChatCompletionRequest), responses=_stream_docs())  # fmt: skip
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    from llmhal.entrypoints.pooling_api import add_pooling_routes

    add_pooling_routes(app, state)  # /v1/embeddings, /pooling, /score, /rerank, /classify
    from llmhal.entrypoints.api_responses import add_responses_routes

    add_responses_routes(app, state)  # /v1/responses

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in (m.CompletionRequest, m.ChatCompletionRequest, m.TokenizeRequest, m.DetokenizeRequest):  # fmt: skip
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _stream_docs() -> dict[int | str, Any]:
    stream = {"text/event-stream": {"schema": {"type": "string"}}}
    return {200: {"content": stream}, **_GEN_DOCS}


def _abort(state: ServerState, plan: gen.Plan) -> None:
    # The loop's lock is held while it steps: abort from a worker, not the event loop.
    state.workers.submit(state.loop.abort, list(plan.rids))


class _EventStream(Response):
    """A streamed answer: server-sent events written as they come, the client watched.
    ``events(gone)`` makes them (chat and completions' chunks by default; /v1/responses' own)."""

    def __init__(self, state: ServerState, plan: gen.Plan, events: Any = None) -> None:
        super().__init__(media_type="text/event-stream")
        self.state, self.plan = state, plan
        self.events = events or (lambda gone: gen.stream_events(state, plan, gone))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        state, plan = self.state, self.plan
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
        ]})  # fmt: skip
        gone = asyncio.ensure_future(gen.wait_disconnect(receive))
        events = self.events(gone)
        state.in_flight += 1
        try:
            async for data in events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (gen.ClientGone, OSError):
            _abort(state, plan)
        finally:
            gone.cancel()
            await events.aclose()
            state.in_flight -= 1
