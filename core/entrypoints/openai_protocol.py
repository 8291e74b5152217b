"""OpenAI-compatible request parsing and response shapes for ``llmhal serve``.

Fields the server does not know are ignored (the server logs each name once), as in vLLM; the
values of those it uses are checked here, and a bad one is a 400 that names the field and its
rule. vLLM's extensions ``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``, ``min_tokens``,
``repetition_penalty``, ``allowed_token_ids``, ``bad_words``, ``include_stop_str_in_output`` and
``prompt_logprobs`` are taken too, and structured outputs as
OpenAI's ``response_format`` (``json_object``, ``json_schema``) or vLLM's ``structured_outputs``, and
vLLM's ``cache_salt`` (requests share cached prompt prefixes only with requests of the same salt).

A response has one choice per prompt and completion: ``n`` completions of each of a completions
request's prompts, choice ``index`` = prompt number * n + completion number (vLLM's numbering).
``echo`` (completions) puts the prompt before each choice's text, and its tokens' log-probabilities
(the first None) before the completion's; with ``max_tokens: 0`` only the prompt comes back (what
evaluation harnesses use to score a text), as in vLLM.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from llmhal.engine.outputs import Logprob, RequestOutput
from llmhal.engine.sampling_params import SamplingParams, finite
from llmhal.structured_output.params import StructuredOutputsParams


class BadRequest(ValueError):
    """The request cannot be served as sent; the message is returned to the client."""


_SAMPLING_FIELDS = {
    "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop", "seed": "seed",
    "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids", "min_tokens": "min_tokens",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty", "allowed_token_ids": "allowed_token_ids",
    "bad_words": "bad_words", "skip_special_tokens": "skip_special_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "prompt_logprobs": "prompt_logprobs",
}  # fmt: skip
# Choices (prompts x n) one request may ask for: each is a request in the engine, and a body of a
# few bytes must not be able to queue millions of them.
MAX_CHOICES = 256


def sampling_params(
    body: dict[str, Any], *, chat: bool, defaults: dict[str, Any] | None = None
) -> SamplingParams:
    """The request's SamplingParams; ``defaults`` (the model's generation_config.json settings,
    under SamplingParams' names) fill what the body leaves out, as in vLLM."""
    guided = sorted(k for k in body if k.startswith("guided_"))
    if guided:  # ignoring them (vLLM logs a warning) would answer unconstrained
        raise BadRequest(f"{', '.join(guided)}: vLLM's removed guided decoding fields; constrain the output with structured_outputs (json, regex, choice, grammar) or response_format")  # fmt: skip
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise BadRequest(f"echo must be true or false, got {echo!r}")
    kwargs: dict[str, Any] = {"max_tokens": None if chat else 16, **(defaults or {})}
    if body.get("n") is not None:
        kwargs["n"] = body["n"]
    for field, name in _SAMPLING_FIELDS.items():
        if body.get(field) is not None:
            kwargs[name] = body[field]
    if chat:
        if body.get("logprobs"):
            kwargs["logprobs"] = body.get("top_logprobs") or 0
    elif body.get("logprobs") is not None:
        kwargs["logprobs"] = body["logprobs"]
        if echo and body.get("prompt_logprobs") is None:
            kwargs["prompt_logprobs"] = body["logprobs"]
    if body.get("logit_bias") is not None:
        kwargs["logit_bias"] = _logit_bias(body["logit_bias"])
    if echo_only(body) and not chat:
        kwargs["max_tokens"] = 1  # one token is generated, then left out of the answer
    try:
        so = structured_outputs(body)
        if so is not None:
            kwargs["structured_outputs"] = so
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e)) from None


def structured_outputs(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` (``text``, ``json_object``, or ``json_schema`` with its
    ``schema``) or vLLM's ``structured_outputs`` object, as SamplingParams takes them."""
    fmt, so = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and so is not None:
        raise BadRequest("send response_format or structured_outputs, not both")
    if so is not None:
        return StructuredOutputsParams.from_dict(so)
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest("response_format json_schema needs json_schema.schema, an object")
        return StructuredOutputsParams(json=schema)
    raise BadRequest(
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {fmt!r}"
    )


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys, so strings) as SamplingParams takes
    it, each bias clamped to [-100, 100] as vLLM does."""
    if not isinstance(value, dict):
        raise BadRequest("logit_bias must be an object mapping token ids to numbers")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}")
        token = int(key)
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not finite(bias):
            raise BadRequest(f"logit_bias values must be finite numbers, got {bias!r} for {key}")
        out[token] = min(100.0, max(-100.0, float(bias)))
    return out


def echo_only(body: dict[str, Any]) -> bool:
    """``echo`` with ``max_tokens: 0``: the prompt (and its log-probabilities) alone."""
    max_tokens = body.get("max_tokens")
    return body.get("echo") is True and type(max_tokens) is int and max_tokens == 0


def without_generation(out: RequestOutput) -> RequestOutput:
    """``out`` with its completion emptied (an echo-only answer's generated token dropped)."""
    c = out.outputs[0]
    empty = dataclasses.replace(
        c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
        cumulative_logprob=None if c.logprobs is None else 0.0, finish_reason="length",
        stop_reason=None,
    )  # fmt: skip
    return dataclasses.replace(out, outputs=[empty])


def stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(whether a stream ends with a usage chunk, whether every chunk carries the usage so far):
    ``stream_options.include_usage`` (OpenAI's) and ``continuous_usage_stats`` (vLLM's, with
    include_usage only)."""
    opts = body.get("stream_options")
    if opts is None:
        return False, False
    if not isinstance(opts, dict):
        raise BadRequest("stream_options must be an object ({include_usage, continuous_usage_stats})")  # fmt: skip
    if not body.get("stream"):
        raise BadRequest("stream_options is only allowed with stream: true")
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        value = opts.get(name, False)
        if not isinstance(value, bool):
            raise BadRequest(f"stream_options.{name} must be true or false")
        flags.append(value)
    return flags[0], flags[0] and flags[1]


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)


def completion_prompts(body: dict[str, Any]) -> list[str | dict[str, Any]]:
    """The prompts of a completions request: a string, a list of token ids, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest(
            "'prompt' must be a string, a list of token ids, or a non-empty list of either"
        )
    out: list[str | dict[str, Any]] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append(p)
        elif _is_ids(p):
            out.append({"prompt_token_ids": p})
        else:
            raise BadRequest(f"prompt {i} must be a string or a non-empty list of token ids")
    return out


def salted(prompts: list[Any], body: dict[str, Any]) -> list[Any]:
    """The prompts with the request's ``cache_salt`` (vLLM's): cached prefixes are shared only
    among requests with the same salt. The engine checks it when it prepares the requests (a
    ValueError, answered 400)."""
    salt = body.get("cache_salt")
    if salt is None:
        return prompts
    return [{**p, "cache_salt": salt} if isinstance(p, dict) else {"prompt": p, "cache_salt": salt} for p in prompts]  # fmt: skip


def choices(prompts: list[Any], params: SamplingParams) -> list[tuple[Any, SamplingParams]]:
    """One (prompt, params) per choice, in choice-index order: each prompt's ``n`` completions
    (with a seed, the i-th uses seed + i, as offline)."""
    if len(prompts) * params.n > MAX_CHOICES:
        raise BadRequest(
            f"{len(prompts)} prompt(s) x n={params.n} is over {MAX_CHOICES} choices per request; "
            "send fewer prompts or a smaller n, or split the request"
        )
    children = params.children()
    return [(p, c) for p in prompts for c in children]


def chat_messages(body: dict[str, Any]) -> list[Any]:
    """The body's messages; each one is checked (and its content normalized) where the chat
    template is applied (``LLM.apply_chat_template``), whose ValueError is the client's 400."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects")
    return messages


def logprobs_of(
    token_ids: list[int],
    entries: list[Any] | None,
    chat: bool,
    token_text: Callable[[int], str],
    text_offset: int = 0,
) -> Any:
    """OpenAI's log-probability shapes for ``token_ids`` and their ``entries`` (None: not asked
    for; an entry None: a first prompt token, which nothing predicts). ``text_offset`` is where the
    tokens start in the text (vLLM's convention; a stream sends each chunk's new tokens).
    ``token_id`` (and the completions' ``token_ids``) are llmhal's additions, since a token's text
    alone can be ambiguous."""
    if entries is None:
        return None
    chosen = list(zip(token_ids, entries, strict=True))

    def entry(t: int, lp: Logprob) -> dict[str, Any]:
        text = token_text(t)
        return {"token": text, "token_id": t, "logprob": _finite(lp.logprob), "bytes": list(text.encode())}  # fmt: skip

    if chat:
        return {
            "content": [
                {**entry(t, lps[t]), "top_logprobs": [entry(k, v) for k, v in lps.items()]}
                for t, lps in chosen
            ]
        }
    tokens = [token_text(t) for t, _ in chosen]
    offsets, at = [], text_offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_ids": [t for t, _ in chosen],
        "token_logprobs": [None if lps is None else _finite(lps[t].logprob) for t, lps in chosen],
        "top_logprobs": [
            None if lps is None else {token_text(k): _finite(v.logprob) for k, v in lps.items()}
            for _, lps in chosen
        ],
        "text_offset": offsets,
    }


# A token a constraint rules out has log-probability -inf, which JSON cannot hold (json.dumps
# writes -Infinity, which strict parsers reject); vLLM sends this floor instead.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def choice_view(
    out: RequestOutput, echo: Callable[[RequestOutput], str] | None
) -> tuple[str, list[int], list[Any] | None]:
    """A choice's text, token ids and log-probability entries; with ``echo`` (which gives the
    prompt's text) the prompt's come first."""
    c = out.outputs[0]
    if echo is None:
        return c.text, c.token_ids, c.logprobs
    prompt = out.prompt_token_ids
    entries = None
    if c.logprobs is not None:
        entries = [*(out.prompt_logprobs or [None] * len(prompt)), *c.logprobs]
    return echo(out) + c.text, [*prompt, *c.token_ids], entries


def usage(outs: list[RequestOutput], n: int = 1, details: bool = False) -> dict[str, Any]:
    """Token counts of a request's choices (``n`` per prompt, in index order); each prompt's
    tokens count once, however many completions it has (vLLM's rule). With ``details`` (vLLM's
    ``--enable-prompt-tokens-details``), OpenAI's ``prompt_tokens_details.cached_tokens``: the
    prompt tokens found in the prefix cache."""
    p = sum(len(o.prompt_token_ids) for o in outs[::n])
    c = sum(len(o.outputs[0].token_ids) for o in outs)
    out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if details:
        out["prompt_tokens_details"] = {
            "cached_tokens": sum(o.num_cached_tokens for o in outs[::n])
        }
    return out


def _envelope(rid: str, kind: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """The fields every completion object and stream chunk carries around its choices."""
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def full_response(
    rid: str,
    model: str,
    outs: list[RequestOutput],
    *,
    chat: bool,
    n: int = 1,
    token_text: Callable[[int], str] = str,
    echo: Callable[[RequestOutput], str] | None = None,
    output: Any = None,
    details: bool = False,
) -> dict[str, Any]:
    """The whole answer: ``outs`` are the final outputs, one per choice, in index order; with
    ``output`` (a chat_output.ChatOutput), each message's reasoning and tool calls are read from
    its text."""
    choices = []
    for index, out in enumerate(outs):
        text, ids, entries = choice_view(out, echo)
        choice: dict[str, Any] = {"index": index}
        finish = out.outputs[0].finish_reason
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if output is not None:
                # The tool parser tells a marker the model produced as one special token from
                # the same string spelled in ordinary tokens by the ids (an echoed prefix has none).
                out_ids = out.outputs[0].token_ids if echo is None else None
                message, finish = output.message(text, finish, out_ids)
            choice["message"] = message
        else:
            choice["text"] = text
        choice["finish_reason"] = finish
        choice["logprobs"] = logprobs_of(ids, entries, chat, token_text)
        choices.append(choice)
    kind = "chat.completion" if chat else "text_completion"
    return {**_envelope(rid, kind, model, choices), "usage": usage(outs, n, details)}


def stream_chunk(
    rid: str,
    model: str,
    delta: str,
    finish: str | None,
    *,
    chat: bool,
    index: int = 0,
    first: bool = False,
    logprobs: Any = None,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str = "",
) -> dict[str, Any]:
    """One server-sent event of a stream: choice ``index``'s new text (and its tokens' log
    probabilities, when asked for, and pieces of tool calls)."""
    if chat:
        # Leave content out of a reasoning-only delta (vLLM's shape).
        d: dict[str, Any] = {} if reasoning and not delta else {"content": delta}
        if first:
            d["role"] = "assistant"
        if tool_calls:
            d["tool_calls"] = tool_calls
        if reasoning:  # vLLM's older and newer names for it
            d["reasoning_content"] = d["reasoning"] = reasoning
        choice = {"index": index, "delta": d, "finish_reason": finish}
    else:
        choice = {"index": index, "text": delta, "finish_reason": finish}
    choice["logprobs"] = logprobs
    kind = "chat.completion.chunk" if chat else "text_completion"
    return _envelope(rid, kind, model, [choice])


def usage_chunk(
    rid: str,
    model: str,
    outs: list[RequestOutput],
    *,
    chat: bool,
    n: int = 1,
    details: bool = False,
) -> dict[str, Any]:
    """A stream's last event under ``stream_options.include_usage``: no choices, the usage."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {**_envelope(rid, kind, model, []), "usage": usage(outs, n, details)}
