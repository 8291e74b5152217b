"""``mistral``: Magistral (Mistral's reasoning models, 2507 on), reasoning between the special
tokens ``[THINK]`` and ``[/THINK]`` written by the model; an answer without ``[THINK]`` is all
content. The tags are special tokens, kept in the text (``adjust_request``)."""

from __future__ import annotations

from typing import Any

from llmhal.reasoning.base import BaseThinkingReasoningParser


class MistralReasoningParser(BaseThinkingReasoningParser):
    start_token = "[THINK]"
    end_token = "[/THINK]"

    def adjust_request(self, request: dict[str, Any]) -> dict[str, Any]:
        return {**request, "skip_special_tokens": False}
