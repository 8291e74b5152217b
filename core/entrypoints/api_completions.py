"""``POST /v1/completions`` and ``POST /v1/chat/completions`` on the asyncio server.

A request is checked, templated, tokenized and submitted on a worker thread (:func:`prepare`), so
the event loop never waits for a tokenizer, a grammar or the engine's lock; the engine loop hands
each update to the event loop through a :class:`Sink`. While an answer is being generated the
client's connection is watched: a client that hangs up (streaming or not) has its requests aborted
at once, which frees their KV blocks.

vLLM's request extras handled here: ``truncate_prompt_tokens`` (the prompt's last N tokens),
``add_special_tokens``, the chat template's ``chat_template_kwargs``, ``documents``,
``add_generation_prompt``, ``continue_final_message`` (and ``chat_template`` with
``--trust-request-chat-template``), chat ``echo`` (the last message, when it has the answer's role,
before each choice's content), ``return_token_ids``, ``prompt_logprobs`` (in full answers, and in each choice's first chunk of
a stream, as vLLM sends them),
``return_tokens_as_token_ids``, ``request_id``, ``stream_options.continuous_usage_stats`` and
``priority`` (with ``--scheduling-policy priority``; else a 400 for any but 0).
``max_tokens`` past the context is a 400 naming both numbers (vLLM's rule), and a prompt is
measured in characters before it is tokenized, so an enormous one costs milliseconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from llmhal.engine.engine_loop import FINISHED, EngineStopped
from llmhal.engine.sampling_params import SamplingParams
from llmhal.entrypoints import chat_tools
from llmhal.entrypoints import openai_protocol as api
from llmhal.entrypoints.api_models import ChatCompletionRequest, CompletionRequest
from llmhal.entrypoints.chat_output import ChatOutput, splits_reasoning
from llmhal.logger import init_logger

logger = init_logger(__name__)


class ClientGone(ConnectionError):
    """The client closed its connection before the answer was complete."""


class Sink:
    """Where the engine loop puts a request's updates: handed to the event loop, never blocking
    the loop thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.q: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.q.put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody is left to tell
            pass


async def wait_disconnect(receive: Callable[[], Any]) -> None:
    """Returns when the client has hung up (the ASGI server sends ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass


@dataclass
class Plan:
    """A request, ready to run: what was submitted and how its answer is written."""

    chat: bool
    body: dict[str, Any]
    req: Any  # the pydantic request
    params: SamplingParams
    rids: list[str]
    sink: Sink
    include_usage: bool
    continuous_usage: bool
    id: str
    echo: Callable[[Any], str] | None  # completions' echo: a choice's prompt text
    echo_prefix: str  # chat's echo: the last message's content
    output: Any  # chat_output.ChatOutput, or None
    token_text: Callable[[int], str]

    @property
    def size(self) -> int:
        return len(self.rids)


def _pydantic_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:3]:
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def _text(content: Any) -> str:
    """A message's content as text (a list of parts: its text parts joined)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _refuse_unsupported(req: Any, chat: bool, state: Any) -> None:
    if getattr(req, "suffix", None) is not None:
        raise api.BadRequest("suffix is not currently supported (as in vLLM); leave it out")
    if req.use_beam_search:
        raise api.BadRequest("use_beam_search is not supported by llmhal; leave it out or false")
    if chat and req.chat_template is not None and not state.trust_request_chat_template:
        raise api.BadRequest(
            "chat_template in a request needs `llmhal serve --trust-request-chat-template` "
            "(a template is code the server runs); leave it out to use the model's"
        )


def _tokens(state: Any, text: str, special: bool, truncate: int | None) -> list[int]:
    if truncate is None and len(text) > state.max_prompt_chars:
        limit = state.max_model_len
        raise api.BadRequest(
            f"The prompt is {len(text)} characters long; the model's context of {limit} tokens "
            f"holds at most {state.max_prompt_chars} characters of it (no token is longer than "
            f"{state.max_prompt_chars // limit}). Shorten the prompt, or send "
            "truncate_prompt_tokens to keep its end."
        )
    return state.llm.get_tokenizer().encode(text, add_special_tokens=special)


def _truncate(ids: list[int], truncate: int | None, limit: int) -> list[int]:
    if truncate is None:
        return ids
    keep = limit if truncate == -1 else truncate
    return ids[max(0, len(ids) - keep) :]


def _check_context(ids: list[int], params: SamplingParams, limit: int) -> None:
    """vLLM's rule: the prompt and max_tokens must fit the context, else a 400 with both."""
    m, p = params.max_tokens, len(ids)
    if m is not None and p + m > limit:
        raise api.BadRequest(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{m} output tokens and your prompt contains {p} input tokens, for a total of "
            f"{p + m} tokens. Please reduce the length of the input prompt or the number of "
            "requested output tokens."
        )


def _chat_prompt(state: Any, req: ChatCompletionRequest, tools: Any) -> dict[str, Any]:
    kwargs = dict(req.chat_template_kwargs or {})
    if req.documents is not None:
        kwargs.setdefault("documents", req.documents)
    text = state.llm.apply_chat_template(
        req.messages,
        req.add_generation_prompt,
        chat_template=req.chat_template,
        continue_final_message=req.continue_final_message,
        tools=tools.tools if tools is not None else None,
        chat_template_kwargs=kwargs,
    )
    ids = _tokens(state, text, req.add_special_tokens, req.truncate_prompt_tokens)
    kept = _truncate(ids, req.truncate_prompt_tokens, state.max_model_len)
    return {"prompt": text if kept is ids else None, "prompt_token_ids": kept}


def _completion_prompts(state: Any, req: CompletionRequest, raw: list[Any]) -> list[Any]:
    out = []
    for p in raw:
        if isinstance(p, str):
            ids = _tokens(state, p, req.add_special_tokens, req.truncate_prompt_tokens)
            text: str | None = p
        else:
            ids, text = p["prompt_token_ids"], None
        kept = _truncate(ids, req.truncate_prompt_tokens, state.max_model_len)
        out.append({"prompt": text if kept is ids else None, "prompt_token_ids": kept})
    return out


def prepare(state: Any, body: dict[str, Any], chat: bool, sink: Sink, request_id: str | None) -> Plan:  # fmt: skip
    """Check, template, tokenize and submit a request (on a worker thread); raises BadRequest,
    ValueError or TypeError for the client's 400, EngineStopped for a 503."""
    model_cls = ChatCompletionRequest if chat else CompletionRequest
    state.note_ignored(set(body) - set(model_cls.model_fields))
    tools = None
    if chat:
        tools = chat_tools.plan(body, state.llm.get_tokenizer(), state.tool_parser_cls, state.auto_tools)  # fmt: skip
        if tools is not None and tools.parser_cls is not None:
            if body.get("stream") and not chat_tools.can_stream(tools.parser_cls):
                raise api.BadRequest(f"the {state.tool_parser_name} tool parser cannot read a stream; send stream: false")  # fmt: skip
            body = tools.parser().adjust_request(body)  # type: ignore[union-attr]
    elif "tools" in body or "tool_choice" in body:
        raise api.BadRequest("tools are only supported on /v1/chat/completions")
    if chat and state.reasoning_cls is not None:  # e.g. keep [THINK] (a special token) in the text
        body = state.reasoning_cls(state.llm.get_tokenizer()).adjust_request(body)
    params = api.sampling_params(body, chat=chat, defaults=state.defaults)
    if tools is not None and tools.structured is not None:
        if params.structured_outputs is not None:
            raise api.BadRequest("a named or required tool_choice already constrains the output; drop response_format/structured_outputs")  # fmt: skip
        params = dataclasses.replace(params, structured_outputs=tools.structured)
    include_usage, continuous = api.stream_options(body)
    raw = api.chat_messages(body) if chat else api.completion_prompts(body)  # their own messages
    try:
        req = model_cls.model_validate(body)
    except ValidationError as e:
        raise api.BadRequest(_pydantic_message(e)) from None
    _refuse_unsupported(req, chat, state)
    if chat:
        prompts = [_chat_prompt(state, req, tools)]
    else:
        prompts = _completion_prompts(state, req, raw)
    for p in prompts:
        _check_context(p["prompt_token_ids"], params, state.max_model_len)
    suffix = request_id or req.request_id or uuid.uuid4().hex
    token_text = state.token_text
    if req.return_tokens_as_token_ids:
        token_text = "token_id:{}".format
    output, echo_prefix = None, ""
    if chat:
        if tools is not None or state.reasoning_cls is not None:
            reasoning_cls = splits_reasoning(
                state.reasoning_cls, state.llm.get_tokenizer(), params.structured_outputs,
                state.llm.engine.reasoner is not None, prompts[0]["prompt_token_ids"],
            )  # fmt: skip
            output = ChatOutput(tools, reasoning_cls, state.llm.get_tokenizer(), body)
        if req.echo:
            last = req.messages[-1]
            role = "assistant" if req.add_generation_prompt else last.get("role")
            echo_prefix = _text(last.get("content")) if last.get("role") == role else ""
    # Submitted last: nothing after this can fail and leave the requests running for nobody.
    rids, _ = state.loop.submit(api.choices(api.salted(prompts, body), params), sink, req.priority)
    return Plan(
        chat=chat, body=body, req=req, params=params, rids=rids, sink=sink,
        include_usage=include_usage, continuous_usage=include_usage and continuous,
        id=f"{'chatcmpl' if chat else 'cmpl'}-{suffix}",
        echo=None if chat or not req.echo else state.prompt_text,
        echo_prefix=echo_prefix, output=output, token_text=token_text,
    )  # fmt: skip


async def updates(plan: Plan, gone: asyncio.Future[Any]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, RequestOutput) as the engine produces them; ClientGone when ``gone``
    finishes first (the client hung up)."""
    echo_only = api.echo_only(plan.body) and not plan.chat
    while True:
        get = asyncio.ensure_future(plan.sink.q.get())
        done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        if get not in done:
            get.cancel()
            raise ClientGone("the client closed the connection")
        item = get.result()
        if item is FINISHED:
            return
        if isinstance(item, Exception):
            raise item
        index, out = item
        yield index, api.without_generation(out) if echo_only else out


def _prompt_logprobs(out: Any) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, None or {token id: {logprob, rank,
    decoded_token}}."""
    if out.prompt_logprobs is None:
        return None
    return [
        None
        if e is None
        else {
            str(t): {
                "logprob": api._finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for t, lp in e.items()
        }  # fmt: skip
        for e in out.prompt_logprobs
    ]


def full_body(state: Any, plan: Plan, last: list[Any]) -> dict[str, Any]:
    body = api.full_response(
        plan.id, state.model_name, last, chat=plan.chat, n=plan.params.n,
        token_text=plan.token_text, echo=plan.echo, output=plan.output,
        details=state.prompt_tokens_details,
    )  # fmt: skip
    want_ids = bool(plan.req.return_token_ids)
    want_plp = plan.req.prompt_logprobs is not None
    for choice, out in zip(body["choices"], last, strict=True):
        choice["stop_reason"] = out.outputs[0].stop_reason
        if want_ids:
            choice["token_ids"] = out.outputs[0].token_ids
        if plan.chat and plan.echo_prefix:
            msg = choice["message"]
            msg["content"] = plan.echo_prefix + (msg.get("content") or "")
        if not plan.chat:
            if want_ids:
                choice["prompt_token_ids"] = out.prompt_token_ids
            if want_plp:
                choice["prompt_logprobs"] = _prompt_logprobs(out)
    if plan.chat:
        if want_ids:
            body["prompt_token_ids"] = last[0].prompt_token_ids
        if want_plp:
            body["prompt_logprobs"] = _prompt_logprobs(last[0])
    return body


def _running_usage(last: list[Any], n: int) -> dict[str, int]:
    p = sum(len(o.prompt_token_ids) for o in last[::n] if o is not None)
    c = sum(len(o.outputs[0].token_ids) for o in last if o is not None)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def stream_events(state: Any, plan: Plan, gone: asyncio.Future[Any]) -> AsyncIterator[bytes]:  # fmt: skip
    """A streamed answer's server-sent events, ``[DONE]`` last."""
    size = plan.size
    chars, tokens, offsets = [0] * size, [0] * size, [0] * size
    started = [False] * size
    last: list[Any] = [None] * size
    streams = [plan.output.stream() for _ in range(size)] if plan.output else None
    want_ids = bool(plan.req.return_token_ids)
    want_plp = plan.req.prompt_logprobs is not None

    def chunk(index: int, delta: str, finish: str | None, out: Any, ids: list[int], **kw: Any) -> bytes:  # fmt: skip
        c = api.stream_chunk(plan.id, state.model_name, delta, finish, chat=plan.chat, index=index, first=not started[index], **kw)  # fmt: skip
        choice = c["choices"][0]
        if want_ids:
            choice["token_ids"] = ids
            if not started[index]:
                if plan.chat:
                    c["prompt_token_ids"] = out.prompt_token_ids
                else:
                    choice["prompt_token_ids"] = out.prompt_token_ids
        if want_plp and not started[index]:  # complete: a prompt is computed before its first token
            (c if plan.chat else choice)["prompt_logprobs"] = _prompt_logprobs(out)
        if finish is not None:
            choice["stop_reason"] = out.outputs[0].stop_reason
        if plan.include_usage:
            c["usage"] = _running_usage(last, plan.params.n) if plan.continuous_usage else None
        started[index] = True
        return sse(c)

    try:
        async for index, out in updates(plan, gone):
            last[index] = out
            if plan.chat and plan.echo_prefix and not started[index]:
                yield chunk(index, plan.echo_prefix, None, out, [])
            text, ids, entries = api.choice_view(out, plan.echo)
            delta = text[chars[index] :]
            if not delta and not out.finished:
                continue  # bytes of a character still incomplete: send them with it
            finish, calls, reasoning = out.outputs[0].finish_reason, [], ""
            if streams is not None:
                delta, reasoning, calls, finish = streams[index].step(text, ids, finish)
                if not delta and not reasoning and not calls and finish is None:
                    continue  # held back (a tag or a call being written)
            new_ids = ids[tokens[index] :]
            logprobs = api.logprobs_of(
                new_ids,
                None if entries is None else entries[tokens[index] :],
                plan.chat,
                plan.token_text,
                offsets[index],
            )
            if logprobs is not None and not plan.chat:
                offsets[index] += sum(len(t) for t in logprobs["tokens"])
            if reasoning and (delta or calls or finish):
                # A delta carries reasoning or an answer, never both (vLLM's rule).
                yield chunk(index, "", None, out, [], reasoning=reasoning)
                reasoning = ""
            yield chunk(
                index, delta, finish, out, new_ids, logprobs=logprobs,
                tool_calls=[c.to_dict() for c in calls], reasoning=reasoning,
            )  # fmt: skip
            chars[index], tokens[index] = len(text), len(ids)
        if plan.include_usage:
            yield sse(api.usage_chunk(plan.id, state.model_name, last, chat=plan.chat, n=plan.params.n, details=state.prompt_tokens_details))  # fmt: skip
    except ClientGone:
        raise
    except Exception as e:
        stopped = isinstance(e, EngineStopped)
        message = f"{e}; the request was ended unfinished" if stopped else f"generation failed: {e}"
        kind = "service_unavailable" if stopped else "server_error"
        code = 503 if stopped else 500
        yield sse({"error": {"message": message, "type": kind, "param": None, "code": code}})
    yield b"data: [DONE]\n\n"
