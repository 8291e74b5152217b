"""Chat conversations: the one shape check shared by ``LLM.chat`` and the server."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def normalize_chat_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Check each message and give it the string ``content`` chat templates expect.

    Accepted, as OpenAI and vLLM send them: ``content`` as a string; as a list of text parts
    (``{"type": "text", "text": ...}``, joined with newlines, vLLM's "string" content format);
    or None/absent on an assistant message that carries ``tool_calls`` (it becomes ""). Other keys
    (``tool_calls``, ``name``, ``tool_call_id``) pass through to the template. Anything else is a
    ValueError naming the message's index (a template would fail with a jinja error far from the
    cause); non-text parts (images, audio) are refused, as no built-in model reads them.
    """
    out = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise ValueError(f"chat message {i} must be a dict with a string 'role', got {m!r}")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(
                        f"chat message {i} has a content part of type {kind!r}; only text parts "
                        f'({{"type": "text", "text": ...}}) are supported'
                    )
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"chat message {i} has a text part without a string 'text'")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None and m.get("role") == "assistant" and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise ValueError(
                f"chat message {i} must have a string 'content' (or a list of text parts), "
                f"got {m!r}"
            )
        out.append({**m, "content": content})
    return out
