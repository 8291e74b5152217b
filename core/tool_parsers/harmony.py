"""OpenAI's harmony format (gpt-oss) read from text: an answer is a run of messages, each
``<|start|>assistant`` (left out of the first, which the prompt opened), a header (channel,
recipient ``to=...``, content type) up to ``<|message|>``, then a body ended by ``<|end|>``,
``<|call|>`` or ``<|return|>``. Shared by the ``openai`` tool parser and the ``gpt_oss``
reasoning parser."""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


@dataclass
class HarmonyMessage:
    header: str  # role, channel, recipient, content type
    body: str
    closed: bool  # ended by <|end|>, <|call|> or <|return|>
    start: int = 0  # where it begins and ends in the text (its end marker included)
    end: int = 0

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
        stop = end + len(marker)
        out.append(HarmonyMessage(text[pos:head_end], text[body_start:end], bool(marker), pos, stop))  # fmt: skip
        if not marker:
            return out
        pos = stop


def message_start(text: str) -> int:
    """Where the first harmony message begins (``<|start|>`` or ``<|channel|>``), or -1."""
    found = [i for i in (text.find(START), text.find(CHANNEL)) if i >= 0]
    return min(found) if found else -1
