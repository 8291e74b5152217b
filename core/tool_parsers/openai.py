"""``openai``: gpt-oss in OpenAI's harmony format. The answer is a run of messages, each
``<|start|>assistant`` (left out of the first, which the prompt opened) then a header and a body:
``<|channel|>analysis<|message|>...<|end|>`` (reasoning),
``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`` (a call; the
recipient may also come before the channel) and ``<|channel|>final<|message|>...<|return|>``
(the answer). Calls are read from the messages addressed to ``functions.*``; the content is the
final channel's text. A text with no harmony markers (the ``gpt_oss`` reasoning parser already
took the channels apart) is content as it stands.

Text before the first message is content too. The markers are special tokens of gpt-oss's vocabulary; the request keeps them in the text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from llmhal.tool_parsers.base import ToolCall
from llmhal.tool_parsers.incremental import IncrementalToolParser, held_back, make_call

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


@dataclass
class HarmonyMessage:
    header: str  # role, channel, recipient, content type
    body: str
    closed: bool  # ended by <|end|>, <|call|> or <|return|>

    @property
    def channel(self) -> str:
        m = _CHANNEL.search(self.header)
        return m.group(1) if m else ""

    @property
    def recipient(self) -> str:
        m = _RECIPIENT.search(self.header)
        return m.group(1) if m else ""


def harmony_messages(text: str, pos: int = 0) -> list[HarmonyMessage]:
    """The messages of a harmony text from ``pos``, in order (the last may be unfinished)."""
    out = []
    while True:
        head_end = text.find(MESSAGE, pos)
        if head_end < 0:
            return out
        body_start = head_end + len(MESSAGE)
        ends = [(i, e) for i, e in ((text.find(e, body_start), e) for e in ENDS) if i >= 0]
        end, marker = min(ends) if ends else (len(text), "")
        out.append(HarmonyMessage(text[pos:head_end], text[body_start:end], bool(marker)))
        if not marker:
            return out
        pos = end + len(marker)


def message_start(text: str) -> int:
    """Where the first harmony message begins (``<|start|>`` or ``<|channel|>``), or -1."""
    found = [i for i in (text.find(START), text.find(CHANNEL)) if i >= 0]
    return min(found) if found else -1


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
