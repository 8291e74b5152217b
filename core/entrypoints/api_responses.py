"""``/v1/responses``: OpenAI's Responses API on the server's engine loop, as vLLM serves it.

``POST /v1/responses`` runs the request as a chat completion (see
:mod:`llmhal.entrypoints.responses_protocol`), streamed as the Responses event types
(``response.created``, ``response.output_item.added``, ``response.output_text.delta``,
``response.reasoning_text.delta``, ``response.function_call_arguments.delta``, their ``.done``
events, ``response.completed`` or ``response.incomplete``) or answered whole. With ``store`` (the
default) the response is kept in a bounded in-memory store (the oldest dropped first, vLLM keeps
them in memory too), so ``GET /v1/responses/{id}`` finds it, ``DELETE`` forgets it and a later
request's ``previous_response_id`` continues its conversation. ``background: true`` answers at
once with a queued response that ``GET`` polls and ``POST /v1/responses/{id}/cancel`` stops.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from llmhal.engine.engine_loop import EngineStopped
from llmhal.entrypoints import openai_protocol as api
from llmhal.entrypoints import responses_protocol as rp
from llmhal.logger import init_logger

logger = init_logger(__name__)

# How many stored responses the server keeps; past it the oldest is forgotten.
MAX_STORED_RESPONSES = 1024


class Stored:
    """One stored response: its object, the conversation it continues (for the next turn), and
    while it runs in the background, its engine requests."""

    def __init__(self, response: dict[str, Any], history: list[dict[str, Any]]) -> None:
        self.response, self.history = response, history
        self.rids: list[str] = []
        self.task: asyncio.Task[Any] | None = None


class ResponseStore:
    """A bounded, thread-safe map of response id -> :class:`Stored` (least recently written
    dropped first)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, item: Stored) -> None:
        with self._lock:
            self._items[rid] = item
            self._items.move_to_end(rid)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            return self._items.get(rid)

    def pop(self, rid: str) -> Stored | None:
        with self._lock:
            return self._items.pop(rid, None)


def _reasoning_tokens(state: Any, text: str) -> int:
    # The parsers split text, not ids: the reasoning's length is its text tokenized again.
    return len(state.llm.get_tokenizer().encode(text, add_special_tokens=False)) if text else 0


def _finished(state: Any, body: dict[str, Any], rid: str, created: float, out: Any, output: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    status = "incomplete" if out.outputs[0].finish_reason == "length" else "completed"
    reasoning = "".join(c["text"] for i in output if i["type"] == "reasoning" for c in i["content"])
    usage = rp.usage(out, _reasoning_tokens(state, reasoning))
    resp = rp.response_object(rid, body, state.model_name, status, output, usage, created=created)  # fmt: skip
    resp["completed_at"] = time.time()
    return resp


class _Events:
    """A streamed response's events, one output item open at a time (reasoning, the message,
    or a function call), each closed with its ``.done`` events before the next opens."""

    def __init__(self, resp: dict[str, Any]) -> None:
        self.resp = resp
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.call_of: dict[int, dict[str, Any]] = {}  # tool-call index -> its item

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}  # type: ignore[index]

    def close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        item["status"] = "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", content_index=0, text=part["text"], logprobs=[], **where))  # fmt: skip
            out.append(self.event("response.content_part.done", content_index=0, part=part, **where))  # fmt: skip
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out.append(self.event("response.reasoning_text.done", content_index=0, text=part["text"], **where))  # fmt: skip
            out.append(self.event("response.content_part.done", content_index=0, part=part, **where))  # fmt: skip
        else:
            out.append(self.event("response.function_call_arguments.done", arguments=item["arguments"], name=item["name"], **where))  # fmt: skip
        out.append(self.event("response.output_item.done", item=item, output_index=where["output_index"]))  # fmt: skip
        return out

    def _start(self, item: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.items.append(item)
        self.open = item
        added = {**item, "status": "in_progress"}
        if item["type"] in ("message", "reasoning"):
            added["content"] = []
        out.append(self.event("response.output_item.added", item=added, output_index=len(self.items) - 1))  # fmt: skip
        if item["type"] in ("message", "reasoning"):
            part = {**item["content"][0]}
            out.append(self.event("response.content_part.added", content_index=0, part=part, **self._where()))  # fmt: skip
        return out

    def reasoning(self, delta: str) -> list[bytes]:
        out = [] if self.open is not None and self.open["type"] == "reasoning" else self._start(rp.reasoning_item(rp.new_id("rs"), "", "in_progress"))  # fmt: skip
        self.open["content"][0]["text"] += delta  # type: ignore[index]
        return out + [self.event("response.reasoning_text.delta", content_index=0, delta=delta, **self._where())]  # fmt: skip

    def text(self, delta: str) -> list[bytes]:
        out = [] if self.open is not None and self.open["type"] == "message" else self._start(rp.message_item(rp.new_id("msg"), "", "in_progress"))  # fmt: skip
        self.open["content"][0]["text"] += delta  # type: ignore[index]
        return out + [self.event("response.output_text.delta", content_index=0, delta=delta, logprobs=[], **self._where())]  # fmt: skip

    def call(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        fn = delta.get("function") or {}
        item = self.call_of.get(delta.get("index", 0))
        if item is None:
            call_id = delta.get("id") or rp.new_id("call")
            item = rp.call_item(rp.new_id("fc"), call_id, fn.get("name") or "", "", "in_progress")
            self.call_of[delta.get("index", 0)] = item
            out += self._start(item)
        elif item is not self.open:  # calls stream one after another; never back to an old one
            raise RuntimeError("a tool call's arguments came after the next call had started")
        args = fn.get("arguments") or ""
        if args:
            item["arguments"] += args
            out.append(self.event("response.function_call_arguments.delta", delta=args, **self._where()))  # fmt: skip
        return out


def add_responses_routes(app: FastAPI, state: Any) -> None:
    """Register /v1/responses on the server's app (``state``: its ServerState)."""
    from llmhal.entrypoints import api_completions as gen
    from llmhal.entrypoints import api_server as srv

    store = ResponseStore()
    state.responses = store
    running: set[asyncio.Task[Any]] = set()  # background responses in progress

    def start(body: dict[str, Any], sink: Any, rid: str) -> tuple[Any, list[dict[str, Any]]]:
        """(the chat plan, submitted; the conversation so far) for a request, on a worker."""
        state.note_ignored(set(body) - rp.READ - rp.PASSED_ON)
        history: list[dict[str, Any]] = []
        prev = body.get("previous_response_id")
        if prev is not None:
            stored = store.get(prev)
            if stored is None:
                raise LookupError(f"previous_response_id {prev!r} is not stored on this server (it keeps the last {store.capacity} responses sent with store: true)")  # fmt: skip
            if stored.response["status"] not in ("completed", "incomplete"):
                raise api.BadRequest(f"previous_response_id {prev!r} is {stored.response['status']}; continue from a finished response")  # fmt: skip
            history = stored.history + rp.as_messages(stored.response["output"])
        chat = rp.chat_body(body, history)
        plan = gen.prepare(state, chat, True, sink, rid)
        return plan, chat["messages"][1:] if body.get("instructions") is not None else chat["messages"]  # fmt: skip

    async def collect(plan: Any, gone: Any) -> Any:
        last = None
        async for _, out in gen.updates(plan, gone):
            last = out
        return last

    def final_output(plan: Any, out: Any) -> list[dict[str, Any]]:
        text = out.outputs[0].text
        if plan.output is None:
            return rp.output_items({"content": text})
        # Its ids too, so a tool-call marker spelled in ordinary tokens stays text (as streamed).
        msg, _ = plan.output.message(text, out.outputs[0].finish_reason, out.outputs[0].token_ids)
        return rp.output_items(msg)

    @app.post("/v1/responses", openapi_extra=_responses_body(), responses=srv._GEN_DOCS)
    async def create(request: Request) -> Response:
        body = await srv.read_json(request, state.max_request_bytes)
        srv._check_model(state, body)
        if body.get("background") and not body.get("store", True):
            raise srv.ApiError(400, "background responses must be stored: drop store: false", "store")  # fmt: skip
        if body.get("background") and body.get("stream"):
            raise srv.ApiError(400, "llmhal streams a response or runs it in the background, not both; drop one", "stream")  # fmt: skip
        loop = asyncio.get_running_loop()
        sink = gen.Sink(loop)
        rid = rp.new_id("resp")
        try:
            plan, history = await loop.run_in_executor(state.workers, start, body, sink, request.headers.get("x-request-id") or rid)  # fmt: skip
        except LookupError as e:
            raise srv.ApiError(404, str(e), "previous_response_id") from None
        except EngineStopped as e:
            raise srv.ApiError(503, str(e)) from None
        except (api.BadRequest, ValueError, TypeError) as e:
            raise srv.ApiError(400, str(e)) from None
        created = time.time()
        keep = bool(body.get("store", True))
        if body.get("stream"):
            return srv._EventStream(state, plan, lambda gone: stream(body, plan, rid, created, history, keep, gone))  # fmt: skip
        if body.get("background"):
            queued = rp.response_object(rid, body, state.model_name, "queued", [], created=created)
            stored = Stored(queued, history)
            stored.rids = list(plan.rids)
            store.put(rid, stored)
            stored.task = asyncio.ensure_future(background(body, plan, rid, created, stored))
            # The loop keeps only a weak reference to a task: held here until it ends, even if
            # the store forgets the response meanwhile.
            running.add(stored.task)
            stored.task.add_done_callback(running.discard)
            return JSONResponse(queued)
        gone = asyncio.ensure_future(gen.wait_disconnect(request.receive))
        state.in_flight += 1
        try:
            out = await collect(plan, gone)
        except gen.ClientGone:
            srv._abort(state, plan)
            return Response(status_code=499)
        except EngineStopped as e:
            raise srv.ApiError(503, f"{e}; the request was ended unfinished") from None
        except Exception as e:  # an engine step failed: still OpenAI's error shape
            raise srv.ApiError(500, f"generation failed: {e}") from None
        finally:
            gone.cancel()
            state.in_flight -= 1
        try:
            resp = _finished(state, body, rid, created, out, final_output(plan, out))
        except Exception as e:  # a parser plugin may fail on this text
            logger.exception("Could not read the answer's reasoning or tool calls")
            raise srv.ApiError(500, f"reading the answer failed: {e}") from None
        if keep:
            store.put(rid, Stored(resp, history))
        return JSONResponse(resp)

    async def background(body: dict[str, Any], plan: Any, rid: str, created: float, stored: Stored) -> None:  # fmt: skip
        stored.response = {**stored.response, "status": "in_progress"}
        never = asyncio.get_running_loop().create_future()  # nobody's connection to watch
        try:
            out = await collect(plan, never)
            if stored.response["status"] == "cancelled":
                return
            stored.response = _finished(state, body, rid, created, out, final_output(plan, out))
        except Exception as e:
            if stored.response["status"] != "cancelled":
                error = {"code": "server_error", "message": f"generation failed: {e}"}
                stored.response = rp.response_object(rid, body, state.model_name, "failed", [], error=error, created=created)  # fmt: skip

    async def stream(body: dict[str, Any], plan: Any, rid: str, created: float, history: list[dict[str, Any]], keep: bool, gone: Any) -> AsyncIterator[bytes]:  # fmt: skip
        ev = _Events(rp.response_object(rid, body, state.model_name, "in_progress", [], created=created))  # fmt: skip
        yield ev.event("response.created", response=ev.resp)
        yield ev.event("response.in_progress", response=ev.resp)
        pieces = plan.output.stream() if plan.output is not None else None
        sent, last = 0, None
        try:
            async for _, out in gen.updates(plan, gone):
                last = out
                text, ids, _ = api.choice_view(out, None)
                finish = out.outputs[0].finish_reason
                if pieces is None:
                    delta, reasoning, calls = text[sent:], "", []
                    sent = len(text)
                else:
                    delta, reasoning, calls, finish = pieces.step(text, ids, finish)
                for chunk in ev.reasoning(reasoning) if reasoning else []:
                    yield chunk
                for chunk in ev.text(delta) if delta else []:
                    yield chunk
                for call in calls:
                    for chunk in ev.call(call.to_dict()):
                        yield chunk
            for chunk in ev.close():
                yield chunk
            if not ev.items:  # nothing was written: still one (empty) message, as when whole
                for chunk in ev.text("") + ev.close():
                    yield chunk
            resp = _finished(state, body, rid, created, last, ev.items)
            kind = "response.incomplete" if resp["status"] == "incomplete" else "response.completed"
            yield ev.event(kind, response=resp)
            if keep:
                store.put(rid, Stored(resp, history))
        except gen.ClientGone:
            raise
        except Exception as e:
            stopped = isinstance(e, EngineStopped)
            message = f"{e}; the request was ended unfinished" if stopped else f"generation failed: {e}"  # fmt: skip
            error = {"code": "server_error", "message": message}
            yield ev.event("response.failed", response=rp.response_object(rid, body, state.model_name, "failed", ev.items, error=error, created=created))  # fmt: skip

    def found(rid: str) -> Stored:
        stored = store.get(rid)
        if stored is None:
            raise srv.ApiError(404, f"Response with id '{rid}' not found (this server keeps the last {store.capacity} stored responses)", "response_id")  # fmt: skip
        return stored

    @app.get("/v1/responses/{response_id}", responses=srv._GEN_DOCS)
    async def retrieve(response_id: str) -> JSONResponse:
        return JSONResponse(found(response_id).response)

    @app.delete("/v1/responses/{response_id}", responses=srv._GEN_DOCS)
    async def delete(response_id: str) -> JSONResponse:
        stored = found(response_id)
        if stored.task is not None and not stored.task.done():
            raise srv.ApiError(400, f"response {response_id} is still running; cancel it first")
        store.pop(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/responses/{response_id}/cancel", responses=srv._GEN_DOCS)
    async def cancel(response_id: str) -> JSONResponse:
        stored = found(response_id)
        if stored.task is None:
            raise srv.ApiError(400, "Cannot cancel a synchronous response: only one created with background: true can be cancelled")  # fmt: skip
        if stored.response["status"] in ("queued", "in_progress"):
            stored.response = {**stored.response, "status": "cancelled"}
            state.workers.submit(state.loop.abort, list(stored.rids))
            stored.task.cancel()  # an aborted request sends no last update to wait for
        return JSONResponse(stored.response)


def _responses_body() -> dict[str, Any]:
    """The request body in /openapi.json: the fields llmhal reads."""
    props: dict[str, Any] = {
        "model": {"type": "string"},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "instructions": {"type": "string"},
        "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {"anyOf": [{"type": "string"}, {"type": "object"}]},
        "text": {"type": "object"},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "stream": {"type": "boolean"},
        "store": {"type": "boolean"},
        "background": {"type": "boolean"},
        "previous_response_id": {"type": "string"},
        "metadata": {"type": "object"},
    }
    schema = {"type": "object", "required": ["input"], "properties": props}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
