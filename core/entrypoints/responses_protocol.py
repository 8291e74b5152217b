"""The Responses API's shapes (``POST /v1/responses``) in terms of chat completions.

A Responses request is turned into the chat-completions body the server already serves
(:func:`chat_body`), so templates, tool-call parsers, reasoning parsers and structured outputs
work the same on both APIs, as in vLLM where the two share the parsers. The answer is written back
as Responses output items (:func:`output_items`) inside a ``response`` object
(:func:`response_object`). Only what llmhal can honour is translated; the rest is refused with a
400 that says what to send instead (an image input, a hosted tool such as web_search) or ignored
and logged, as the chat API does with fields it does not use.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from llmhal.entrypoints.openai_protocol import BadRequest

# Fields of OpenAI's request that llmhal reads; vLLM's extras it passes on to the chat request.
READ = {
    "model", "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens",
    "temperature", "top_p", "stream", "store", "previous_response_id", "metadata", "background",
    "parallel_tool_calls", "reasoning", "user", "truncation", "service_tier", "include",
}  # fmt: skip
PASSED_ON = {
    "seed", "top_k", "min_p", "repetition_penalty", "stop", "structured_outputs", "priority",
    "chat_template_kwargs", "skip_special_tokens", "ignore_eos", "min_tokens", "request_id",
    "cache_salt", "presence_penalty", "frequency_penalty",
}  # fmt: skip
_TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _content_text(content: Any, where: str) -> str:
    """A message item's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of input_text parts")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise BadRequest(
                f"{where}.content[{i}] has type {kind!r}; llmhal serves text models and reads "
                f"only {', '.join(_TEXT_PARTS)} parts"
            )
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` (a string, or a list of message / function_call / function_call_output /
    reasoning items) as chat messages. Reasoning items are left out: a chat template drops a
    previous turn's reasoning, and the model never needs it back."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise BadRequest("input must be a string or a list of input items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object (a message or a function call item)")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(f"{where}.role must be user, assistant, system or developer, got {role!r}")  # fmt: skip
            # Chat templates know "system"; "developer" is OpenAI's newer name for it.
            out.append({"role": "system" if role == "developer" else role, "content": _content_text(item.get("content"), where)})  # fmt: skip
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise BadRequest(f"{where} (function_call) needs {key}, a string")
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise BadRequest(f"{where} (function_call_output) needs call_id, a string")
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, where)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise BadRequest(
                f"{where} has type {kind!r}; llmhal reads message, function_call, "
                "function_call_output and reasoning items"
            )
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list of {type: function, name, parameters} objects")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise BadRequest(
                f"tools[{i}] has type {kind!r}; llmhal runs function tools only (hosted tools such "
                "as web_search or file_search need OpenAI's servers)"
            )
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):  # fmt: skip
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadRequest(f"tool_choice must be 'auto', 'none', 'required' or {{type: function, name}}, got {choice!r}")  # fmt: skip


def _response_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (which checks it): json_schema's schema and
    name move under ``json_schema``, the other types are the same."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = {"name": fmt.get("name") or "output", "schema": fmt.get("schema")}
        return {"type": "json_schema", "json_schema": spec}
    return fmt


def chat_body(body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions request a Responses request runs as. ``history``: the messages of
    the conversation ``previous_response_id`` continues (its instructions not carried over,
    as OpenAI documents)."""
    if "input" not in body:
        raise BadRequest("input is required: a string or a list of input items")
    messages = list(history)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("instructions must be a string")
        messages.insert(0, {"role": "system", "content": instructions})
    messages += input_messages(body["input"])
    chat: dict[str, Any] = {"messages": messages, "stream": bool(body.get("stream"))}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p", *PASSED_ON):
        if body.get(key) is not None:
            chat[key] = body[key]
    tools = _tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat


def usage(out: Any, reasoning_tokens: int) -> dict[str, Any]:
    prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": out.num_cached_tokens or 0,
            "cache_write_tokens": 0,
        },  # fmt: skip
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt + completion,
    }


def reasoning_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": rid, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def message_item(mid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}  # fmt: skip


def call_item(fid: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:  # fmt: skip
    return {"id": fid, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def output_items(msg: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished chat message (content, reasoning, tool calls) as Responses output items:
    reasoning first, then the text, then each function call."""
    items = []
    if msg.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), msg["reasoning_content"]))
    calls = msg.get("tool_calls") or []
    if msg.get("content") or not calls:
        items.append(message_item(new_id("msg"), msg.get("content") or ""))
    for c in calls:
        fn = c["function"]
        items.append(call_item(new_id("fc"), c.get("id") or new_id("call"), fn["name"], fn["arguments"]))  # fmt: skip
    return items


def as_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a following turn continues from."""
    return input_messages([i for i in items if i["type"] != "reasoning"]) if items else []


def response_object(
    rid: str, body: dict[str, Any], model: str, status: str, output: list[dict[str, Any]],
    usage_: dict[str, Any] | None = None, error: dict[str, Any] | None = None,
    created: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """OpenAI's ``response`` object, echoing the request's settings."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    tools = [{"strict": None, **t} for t in body.get("tools") or [] if isinstance(t, dict)]
    return {
        "id": rid,
        "object": "response",
        "created_at": created if created is not None else time.time(),
        "model": model,
        "status": status,
        "output": output,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": tools,
        "text": body.get("text") or {"format": {"type": "text"}},
        "truncation": body.get("truncation") or "disabled",
        "background": bool(body.get("background")),
        "store": body.get("store", True),
        "usage": usage_,
        "error": error,
        "incomplete_details": incomplete,
        "reasoning": body.get("reasoning"),
        "user": body.get("user"),
    }
