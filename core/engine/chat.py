"""Chat conversations: the one shape check shared by ``LLM.chat`` and the server."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def check_chat_messages(messages: Sequence[Any]) -> None:
    """Raise ValueError naming the first message that is not {string role, string content}
    (a chat template would otherwise fail with a jinja error far from the cause)."""
    for i, m in enumerate(messages):
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise ValueError(
                f"chat message {i} must be a dict with a string 'role' and a string 'content', "
                f"got {m!r}"
            )
