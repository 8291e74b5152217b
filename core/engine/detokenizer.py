"""Incremental detokenisation: text that streams correctly across multi-byte characters.

A token may end in the middle of a UTF-8 character (byte-level BPE) or change how the previous
token renders (SentencePiece spaces). So each step decodes a short window of recent tokens twice,
with and without the new ones, and emits only the stable difference; a window ending in U+FFFD (an
incomplete character) is held back until the next token completes it.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as left context so the first output token renders as it would mid-text.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append generated tokens; return the newly stable text (possibly empty)."""
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation, emit whatever is held back (even an incomplete character)."""
        full = self._decode(self._ids[self._prefix_offset :])
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
