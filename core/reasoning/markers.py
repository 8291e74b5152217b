"""Reasoning delimited by marker texts that need not be single tokens: ``<think>`` written as
three pieces by Hunyuan's vocabulary, Granite's "Here is my thought process:", gpt-oss's
``<|channel|>final<|message|>``. Each marker may have alternatives.

The text split (:meth:`MarkerReasoningParser._split`) works as the single-token parsers' does.
The id-based answers decode the ids they are given (special tokens kept) and look for the
markers' text, since a marker's token ids depend on what surrounds it; a prompt's answer looks
only after the last ``anchor`` (the assistant turn's opening), so that a system prompt which
names the markers (Granite's does) is not taken for a finished reasoning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmhal.reasoning.base import SplitReasoningParser


def find_first(text: str, markers: Sequence[str], start: int = 0) -> tuple[int, str]:
    """(position, marker) of the earliest of ``markers`` in ``text`` from ``start``; (-1, "")."""
    found = [(i, m) for i, m in ((text.find(m, start), m) for m in markers) if i >= 0]
    return min(found, key=lambda f: (f[0], -len(f[1]))) if found else (-1, "")


def partial_any(text: str, markers: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could begin one of ``markers``."""
    return max((SplitReasoningParser._partial(text, m) for m in markers), default=0)


def unwrap(text: str, opening: str, closing: str, final: bool) -> str:
    """``text`` without an ``opening`` tag at its start and a ``closing`` one (with what follows
    it) and the newline next to each; unless ``final``, a piece that may become either is held
    back, so the result only grows as ``text`` does (ERNIE's ``<response>``, Hunyuan's
    ``<answer>``)."""
    body = text.lstrip("\n")
    if body.startswith(opening):
        body = body[len(opening) :]
        body = body[1:] if body.startswith("\n") else body
    elif not final and opening.startswith(body):
        return ""
    cut = body.find(closing)
    if cut >= 0:
        body = body[:cut]
        return body[:-1] if body.endswith("\n") else body
    if final:
        return body
    body = body[: len(body) - SplitReasoningParser._partial(body, "\n" + closing)]
    return body[: len(body) - SplitReasoningParser._partial(body, closing)]


class MarkerReasoningParser(SplitReasoningParser):
    """Reasoning from a start marker (any of ``start_markers``; with ``starts_inside`` from the
    output's beginning, the template having opened it) to an end marker; text before the start
    and after the end is content, and an output without a start marker is all content. With
    ``start_at_beginning`` a start marker counts only as the output's first text."""

    start_markers: tuple[str, ...] = ()
    end_markers: tuple[str, ...] = ()
    starts_inside: bool = False
    start_at_beginning: bool = False
    anchor: str = ""

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        if tokenizer is None:
            raise ValueError(f"{type(self).__name__} needs the model's tokenizer")
        if not self.end_markers or not (self.start_markers or self.starts_inside):
            raise ValueError(f"{type(self).__name__} must name its markers")
        encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
        self._end_ids = [encode(m) for m in self.end_markers]
        self._anchor_ids = encode(self.anchor) if self.anchor else []
        # enough trailing tokens to hold any end marker, however it is split into tokens
        self._window = 2 + max(len(m) for m in self.end_markers)

    # -- the text split --------------------------------------------------------------------
    def _tidy(self, reasoning: str, content: str, ended: bool, final: bool) -> tuple[str, str]:
        """Subclasses trim what surrounds the markers (newlines, wrapper tags)."""
        return reasoning, content

    def _start(self, text: str, final: bool) -> tuple[int, int] | None:
        """(where the start marker is, where the reasoning begins), or None when there is none
        (yet): then the text is content."""
        if self.starts_inside:
            return 0, 0
        pos, marker = find_first(text, self.start_markers)
        if pos < 0 or (self.start_at_beginning and text[:pos].strip()):
            return None
        return pos, pos + len(marker)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        found = self._start(text, final)
        if found is None:
            if final:
                return self._tidy("", text, False, final)
            if self.start_at_beginning:
                head = text.lstrip()
                if any(m.startswith(head) for m in self.start_markers):
                    return "", ""  # it may still open with the marker
                return self._tidy("", text, False, final)
            return self._tidy("", text[: len(text) - partial_any(text, self.start_markers)], False, final)  # fmt: skip
        pos, begin = found
        before = text[:pos]
        end, marker = find_first(text, self.end_markers, begin)
        if end >= 0:
            return self._tidy(text[begin:end], before + text[end + len(marker) :], True, final)
        body = text[begin:]
        if not final:
            body = body[: len(body) - partial_any(body, self.end_markers)]
        return self._tidy(body, before, False, final)

    def _ended(self, text: str) -> bool:
        """Whether the last reasoning in ``text`` was closed: an end marker after the last start
        marker (after none, with ``starts_inside``), so that an earlier turn's closed reasoning
        in a prompt does not count for the one being written."""
        last_start = max((text.rfind(m) for m in self.start_markers), default=-1)
        last_end = max((text.rfind(m) for m in self.end_markers), default=-1)
        if last_start < 0 and not self.starts_inside:
            return False
        if self.start_at_beginning and last_start >= 0 and text[:last_start].strip():
            return False  # a start marker that does not open the answer starts nothing
        return last_end > last_start

    # -- the id-based answers ----------------------------------------------------------------
    def _decode(self, ids: Sequence[int]) -> str:
        return self.model_tokenizer.decode(list(ids), skip_special_tokens=False)

    def _after_anchor(self, ids: Sequence[int]) -> Sequence[int]:
        a = self._anchor_ids
        if a:
            for i in range(len(ids) - len(a), -1, -1):
                if all(ids[i + j] == a[j] for j in range(len(a))):
                    return [ids[k] for k in range(i + len(a), len(ids))]
        return ids

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        return self._ended(self._decode(self._after_anchor(input_ids)))

    def is_reasoning_end_streaming(
        self, input_ids: Sequence[int], delta_ids: Sequence[int]
    ) -> bool:
        """Whether an end marker was completed by ``delta_ids`` (the last of ``input_ids``)."""
        n, k = len(input_ids), self._window + len(delta_ids)
        tail_ids = [input_ids[i] for i in range(max(0, n - k), n)]
        tail = self._decode(tail_ids)
        before = len(self._decode(tail_ids[: len(tail_ids) - len(delta_ids)]))
        return any((i := tail.rfind(m)) >= 0 and i + len(m) > before for m in self.end_markers)

    def _end_index(self, ids: Sequence[int]) -> int:
        """The index just past the first end marker's token ids (as it encodes alone), or -1."""
        ids = list(ids)
        for i in range(len(ids)):
            for seq in self._end_ids:
                if seq and ids[i : i + len(seq)] == seq:
                    return i + len(seq)
        return -1

    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        end = self._end_index(input_ids)
        return list(input_ids)[end:] if 0 <= end < len(input_ids) else []

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        end = self._end_index(token_ids)
        if not self.starts_inside and not self._start(self._decode(token_ids), True):
            return 0
        return end if end >= 0 else len(token_ids)
