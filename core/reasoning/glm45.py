"""``glm45``: GLM-4.5/4.6, ``<think>...</think>`` written by the model (an answer without
``<think>`` is all content; ``enable_thinking=False`` makes the template write an empty
``<think></think>`` into the prompt). Every past assistant turn of GLM's template carries its own
tags, so the id-based end check looks no further back than the last ``<|assistant|>``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmhal.reasoning.base import BaseThinkingReasoningParser


class Glm45ReasoningParser(BaseThinkingReasoningParser):
    start_token = "<think>"
    end_token = "</think>"
    assistant_token = "<|assistant|>"

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        self.assistant_token_id = self._token_id(self.assistant_token)  # None: not a GLM vocabulary

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        for t in reversed(input_ids):
            if t == self.end_token_id:
                return True
            if t in (self.start_token_id, self.assistant_token_id):
                return False
        return False
