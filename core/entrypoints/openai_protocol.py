"""OpenAI-compatible request parsing and response shapes for ``llmhal serve``.

Only what the engine really supports is accepted; anything else is a 400 that names the field.
vLLM's extensions ``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``, ``min_tokens`` and
``repetition_penalty`` are accepted too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from llmhal.engine.outputs import Logprob, RequestOutput
from llmhal.engine.sampling_params import SamplingParams


class BadRequest(ValueError):
    """The request cannot be served as sent; the message is returned to the client."""


_SAMPLING_FIELDS = {
    "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop", "seed": "seed",
    "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids", "min_tokens": "min_tokens",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
}  # fmt: skip
_IGNORED = {
    "model",
    "stream",
    "user",
    "n",
    "logprobs",
    "top_logprobs",
    "stream_options",
    "messages",
    "prompt",
}


def sampling_params(
    body: dict[str, Any], *, chat: bool, defaults: dict[str, Any] | None = None
) -> SamplingParams:
    """The request's SamplingParams; ``defaults`` (the model's generation_config.json settings,
    under SamplingParams' names) fill what the body leaves out, as in vLLM."""
    unknown = sorted(set(body) - set(_SAMPLING_FIELDS) - _IGNORED - {"echo"})
    if unknown:
        raise BadRequest(f"unsupported field(s): {', '.join(unknown)}")
    if body.get("echo"):
        raise BadRequest("echo is not supported (send false or leave it out)")
    if body.get("n", 1) != 1:
        raise BadRequest("n must be 1")
    kwargs: dict[str, Any] = {"max_tokens": None if chat else 16, **(defaults or {})}
    for field, name in _SAMPLING_FIELDS.items():
        if body.get(field) is not None:
            kwargs[name] = body[field]
    if chat:
        if body.get("logprobs"):
            kwargs["logprobs"] = body.get("top_logprobs") or 0
    elif body.get("logprobs") is not None:
        kwargs["logprobs"] = body["logprobs"]
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e)) from None


def completion_prompt(body: dict[str, Any]) -> str | dict[str, Any]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return {"prompt_token_ids": prompt}
    raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)")


def chat_messages(body: dict[str, Any]) -> list[Any]:
    """The body's messages; each one is checked (and its content normalized) where the chat
    template is applied (``LLM.apply_chat_template``), whose ValueError is the client's 400."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects")
    return messages


def _logprobs(out: RequestOutput, chat: bool, token_text: Callable[[int], str]) -> Any:
    """OpenAI's log-probability shapes; ``token_id`` (and the completions' ``token_ids``) are
    llmhal's additions, since a token's text alone can be ambiguous."""
    c = out.outputs[0]
    if c.logprobs is None:
        return None
    chosen = list(zip(c.token_ids, c.logprobs, strict=True))

    def entry(t: int, lp: Logprob) -> dict[str, Any]:
        text = token_text(t)
        return {"token": text, "token_id": t, "logprob": lp.logprob, "bytes": list(text.encode())}

    if chat:
        return {
            "content": [
                {**entry(t, lps[t]), "top_logprobs": [entry(k, v) for k, v in lps.items()]}
                for t, lps in chosen
            ]
        }
    tokens = [token_text(t) for t in c.token_ids]
    offsets, at = [], 0  # vLLM's convention: offsets into the returned text
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_ids": c.token_ids,
        "token_logprobs": [lps[t].logprob for t, lps in chosen],
        "top_logprobs": [{token_text(k): v.logprob for k, v in lps.items()} for lps in c.logprobs],
        "text_offset": offsets,
    }


def usage(out: RequestOutput) -> dict[str, int]:
    p, c = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _envelope(rid: str, kind: str, model: str, choice: dict[str, Any]) -> dict[str, Any]:
    """The fields every completion object and stream chunk carries around its one choice."""
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def full_response(
    rid: str,
    model: str,
    out: RequestOutput,
    *,
    chat: bool,
    token_text: Callable[[int], str] = str,
) -> dict[str, Any]:
    c = out.outputs[0]
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": c.text},
            "finish_reason": c.finish_reason,
            "logprobs": _logprobs(out, True, token_text),
        }
    else:
        choice = {
            "index": 0,
            "text": c.text,
            "finish_reason": c.finish_reason,
            "logprobs": _logprobs(out, False, token_text),
        }
    kind = "chat.completion" if chat else "text_completion"
    return {**_envelope(rid, kind, model, choice), "usage": usage(out)}


def stream_chunk(
    rid: str, model: str, delta: str, finish: str | None, *, chat: bool, first: bool = False
) -> dict[str, Any]:
    if chat:
        d: dict[str, Any] = {"content": delta}
        if first:
            d["role"] = "assistant"
        choice = {"index": 0, "delta": d, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": delta, "finish_reason": finish}
    kind = "chat.completion.chunk" if chat else "text_completion"
    return _envelope(rid, kind, model, choice)
