"""``POST /tokenize`` and ``POST /detokenize``: vLLM's request and response shapes.

``/tokenize`` takes ``{"prompt": str}`` (``add_special_tokens`` defaults to true, as a completion
prompt is encoded) or ``{"messages": [...]}`` (the chat template applied as a chat completion
applies it; ``add_generation_prompt`` defaults to true, ``add_special_tokens`` to false since the
template holds them), and answers ``{"count", "max_model_len", "tokens", "token_strs"}``, the token
strings only with ``return_token_strs``. ``/detokenize`` takes ``{"tokens": [ids]}`` and answers
``{"prompt": text}`` (special tokens kept). The ids are the ones the completion endpoints would
use for the same input, so a client can count or trim a prompt before sending it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmhal.entrypoints.openai_protocol import BadRequest, chat_messages

_TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                    "continue_final_message", "return_token_strs"}  # fmt: skip


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r}")
    return value


def _ignore(note: Callable[[set[str]], None] | None, fields: set[str]) -> None:
    """Unknown fields are ignored (vLLM's rule), and ``note`` logs their names."""
    if fields and note is not None:
        note(fields)


def tokenize(body: dict[str, Any], llm: Any, note: Callable[[set[str]], None] | None = None) -> dict[str, Any]:  # fmt: skip
    _ignore(note, set(body) - _TOKENIZE_FIELDS)
    if ("prompt" in body) == ("messages" in body):
        raise BadRequest("send either 'prompt' (a string) or 'messages' (a chat), not both")
    if "messages" in body:
        text = llm.apply_chat_template(
            chat_messages(body),
            _flag(body, "add_generation_prompt", True),
            continue_final_message=_flag(body, "continue_final_message", False),
        )
        special = _flag(body, "add_special_tokens", False)
    else:
        if not isinstance(body["prompt"], str):
            raise BadRequest("'prompt' must be a string (token ids are already tokens)")
        text, special = body["prompt"], _flag(body, "add_special_tokens", True)
    ids = llm.get_tokenizer().encode(text, add_special_tokens=special)
    strs = None
    if _flag(body, "return_token_strs", False):
        strs = llm.get_tokenizer().convert_ids_to_tokens(ids)
    return {
        "count": len(ids),
        "max_model_len": llm.engine.config.model.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize(body: dict[str, Any], llm: Any, note: Callable[[set[str]], None] | None = None) -> dict[str, Any]:  # fmt: skip
    _ignore(note, set(body) - {"model", "tokens"})
    ids = body.get("tokens")
    vocab = len(llm.get_tokenizer())
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise BadRequest("'tokens' must be a list of token ids (integers)")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    return {"prompt": llm.get_tokenizer().decode(ids)}
