"""``ernie45``: ERNIE-4.5 thinking models. The chat template opens the reasoning, so the answer
starts inside it (as R1's): ``reasoning\\n</think>\\n\\n<response>\\nanswer\\n</response>`` or
``reasoning\\n</think>\\nanswer``. The content is the answer without its ``<response>`` tags and
the newlines around them."""

from __future__ import annotations

from llmhal.reasoning.base import BaseThinkingReasoningParser
from llmhal.reasoning.markers import unwrap


class Ernie45ReasoningParser(BaseThinkingReasoningParser):
    start_token = "<think>"
    end_token = "</think>"
    starts_inside = True

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content = super()._split(text, final)
        return reasoning, unwrap(content, "<response>", "</response>", final)
