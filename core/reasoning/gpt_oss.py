"""``gpt_oss`` (vLLM's ``openai_gptoss``): gpt-oss's harmony answer
(:mod:`llmhal.tool_parsers.harmony`). The ``analysis`` channel's messages are the reasoning; the
``final`` channel's text (and a preamble on ``commentary`` without a recipient) is the content;
a message addressed to a tool stays in the content in its harmony form, for the ``openai``
tool-call parser to read. The reasoning is over once ``<|channel|>final<|message|>`` is written
(the id-based answers, after the last ``<|start|>assistant``). The markers are special tokens,
kept in the text (``adjust_request``)."""

from __future__ import annotations

from typing import Any

from llmhal.reasoning.markers import MarkerReasoningParser, partial_any
from llmhal.tool_parsers.harmony import CHANNEL, ENDS, START, harmony_messages, message_start


class GptOssReasoningParser(MarkerReasoningParser):
    end_markers = ("<|channel|>final<|message|>",)
    starts_inside = True
    anchor = "<|start|>assistant"

    def adjust_request(self, request: dict[str, Any]) -> dict[str, Any]:
        return {**request, "skip_special_tokens": False}

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        first = message_start(text)
        if first < 0:  # not (yet) harmony: plain text is content
            return "", text if final else text[: len(text) - partial_any(text, (START, CHANNEL))]
        reasoning: list[str] = []
        content = [text[:first]]
        for msg in harmony_messages(text, first):
            body = msg.body if msg.closed or final else msg.body[: len(msg.body) - partial_any(msg.body, ENDS)]  # fmt: skip
            if msg.recipient:  # a call: whole, in its harmony form, once it has ended
                if msg.closed or final:
                    content.append(START + text[msg.start : msg.end].removeprefix(START))
            elif msg.channel == "analysis":
                reasoning.append(body)
            else:
                content.append(body)
        return "\n".join(reasoning), "".join(content)
