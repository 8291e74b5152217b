"""``openai``: gpt-oss in OpenAI's harmony format (:mod:`llmhal.tool_parsers.harmony`): a call
is a message addressed to a function,
``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`` (the
recipient may also come before the channel); the content is the text before the first message
and the ``final`` channel's text; ``analysis`` messages are reasoning, left out (the ``gpt_oss``
reasoning parser puts them apart and leaves the calls in their harmony form for this parser).
A text with no harmony message is content as it stands. The markers are special tokens of
gpt-oss's vocabulary; the request keeps them in the text.
"""

from __future__ import annotations

from typing import Any

from llmhal.tool_parsers.base import ToolCall
from llmhal.tool_parsers.harmony import CHANNEL, ENDS, START, harmony_messages, message_start
from llmhal.tool_parsers.incremental import IncrementalToolParser, held_back, make_call


class OpenAIToolParser(IncrementalToolParser):
    """Text before the first message (none in a raw gpt-oss answer; the content that the
    ``gpt_oss`` reasoning parser left) is content, followed by the final channel's text."""

    def read(self, text: str, request: dict[str, Any], final: bool) -> tuple[str, list[ToolCall]]:
        first = message_start(text)
        if first < 0:
            return (text if final else text[: len(text) - held_back(text, (START, CHANNEL))]), []
        content, calls = [text[:first]], []
        for msg in harmony_messages(text, first):
            if msg.recipient.startswith("functions."):
                if msg.closed or final:
                    try:
                        calls.append(make_call(msg.recipient[len("functions.") :], msg.body))
                    except ValueError:
                        continue  # malformed arguments: skipped
            elif msg.channel == "final":
                body = msg.body
                if not (msg.closed or final):
                    body = body[: len(body) - held_back(body, ENDS)]
                content.append(body)
        return "".join(content), calls
