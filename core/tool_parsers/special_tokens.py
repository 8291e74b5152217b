"""Which special-token strings in a model's text are the tokens themselves.

Most families' call markers (``<tool_call>``, ``[TOOL_CALLS]``, ``<|python_tag|>``, DeepSeek's
``<｜tool▁calls▁begin｜>``) are added tokens of their vocabulary: the model opens a call by
producing that one token id. The same characters can also come out as ordinary tokens, when the
model writes about the format (``use the <tool_call> tag``) or quotes it in an argument; vLLM's
parsers tell the two apart by looking for the marker's id among the output's token ids. Here a
parser given the ids reads a text in which every added-token string the model did not produce as
its token is made inert (its first character swapped for a Unicode noncharacter, swapped back in
what the parser returns), so a marker written in ordinary tokens stays text, in the finished
reading and in the stream alike. Without ids, or when the ids do not line up with the text (a
tokenizer that changes the text around special tokens when decoding), the text is read as it is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

# Noncharacters (U+FDD0..U+FDEF), which never appear in interchanged text, stand for the first
# character of an inert marker; a text that has one already is read as it is.
_INERT = [chr(c) for c in range(0xFDD0, 0xFDF0)]
_HAS_INERT = re.compile("[\ufdd0-\ufdef]")


class SpecialTokenText:
    """One per parser (a request): the tokenizer's added tokens, and where in the output the
    model produced them (cached: a stream adds ids at the end)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        # Single characters and whitespace tokens are never markers.
        self.strings = {int(i): str(t) for i, t in added.items() if len(str(t)) > 1 and str(t).strip() == str(t)}  # fmt: skip
        heads = sorted({s[0] for s in self.strings.values()})
        self.usable = bool(self.strings) and len(heads) <= len(_INERT)
        self._inert = dict(zip(heads, _INERT, strict=False))
        self._restore = {ord(v): k for k, v in self._inert.items()}
        by_length = sorted(set(self.strings.values()), key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, by_length))) if self.usable else None
        self._ids: list[int] = []  # the ids read so far
        self._produced: dict[int, str] = {}  # text offset -> the added token produced there

    def _offsets(self, ids: Sequence[int]) -> dict[int, str]:
        """Text offset -> added-token string, for each added token among ``ids``."""
        n = len(self._ids)
        if len(ids) < n or list(ids[:n]) != self._ids:  # not a continuation: start over
            self._ids, self._produced, n = [], {}, 0
        for k in range(n, len(ids)):
            s = self.strings.get(int(ids[k]))
            if s is not None:
                before = self.tokenizer.decode(list(ids[:k]), skip_special_tokens=False)
                self._produced[len(before)] = s
        self._ids = [int(i) for i in ids]
        return self._produced

    def inert(self, text: str, ids: Sequence[int] | None) -> tuple[str, dict[int, str] | None]:
        """``text`` with the added-token strings the model did not produce as tokens made inert,
        and the translation table that undoes it (None: the text is unchanged)."""
        if not ids or not self.usable or _HAS_INERT.search(text):
            return text, None
        matches = list(self._pattern.finditer(text))  # type: ignore[union-attr]
        if not matches:
            return text, None
        produced = self._offsets(ids)
        for at, s in produced.items():  # the ids and the text must agree where both reach
            if at + len(s) <= len(text) and not text.startswith(s, at):
                return text, None
        literal = [m.start() for m in matches if produced.get(m.start()) != m.group()]
        if not literal:
            return text, None
        # Before taking a marker for text, make sure the text is these ids' text (a caller
        # may pass a part of the output, e.g. the content after the reasoning, with all ids).
        whole = self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
        if not whole.startswith(text):
            return text, None
        chars = list(text)
        for at in literal:
            chars[at] = self._inert[chars[at]]
        return "".join(chars), self._restore

    @staticmethod
    def restore(text: str | None, table: dict[int, str] | None) -> str | None:
        return text if text is None or table is None else text.translate(table)
