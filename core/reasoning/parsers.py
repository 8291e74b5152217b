"""Built-in reasoning parsers: ``<think>...</think>`` models."""

from __future__ import annotations

from llmhal.reasoning.base import BaseThinkingReasoningParser


class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    """DeepSeek-R1 and its distills: the chat template opens ``<think>``, so the output starts
    inside the reasoning (an output without ``</think>`` is all reasoning, cut short)."""

    start_token = "<think>"
    end_token = "</think>"
    starts_inside = True


class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    """Qwen3: ``<think>...</think>`` when thinking is on; an output without ``<think>`` (thinking
    off) is all content. Models whose chat template opens ``<think>`` itself (Qwen3 thinking-2507)
    take ``deepseek_r1``."""

    start_token = "<think>"
    end_token = "</think>"
