"""The reasoning-parser contract (vLLM's ``ReasoningParser``): split a reasoning model's output
into its reasoning (``<think>...</think>`` and the like) and its answer.

A parser is built per request with the engine's tokenizer. ``extract_reasoning`` reads a finished
output and returns ``(reasoning, content)``, either None when absent; ``extract_reasoning_streaming``
is called with each new piece of a streamed output and returns what the piece adds to each (a
:class:`DeltaMessage` with ``reasoning`` or ``content``, or None for nothing). The id-based
methods (``is_reasoning_end``, ``extract_content_ids``) answer from token ids alone.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class DeltaMessage:
    reasoning: str | None = None
    content: str | None = None


class ReasoningParser:
    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        self.model_tokenizer = tokenizer

    @functools.cached_property
    def vocab(self) -> dict[str, int]:
        return self.model_tokenizer.get_vocab()

    def adjust_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """The request body before generation (vLLM's hook; default: unchanged). Parsers whose
        markers are special tokens ask to keep them in the text (``skip_special_tokens``)."""
        return request

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        raise NotImplementedError

    def is_reasoning_end_streaming(
        self, input_ids: Sequence[int], delta_ids: Sequence[int]
    ) -> bool:
        return self.is_reasoning_end(input_ids)

    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        raise NotImplementedError

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        return 0

    def extract_reasoning(
        self, model_output: str, request: Any = None
    ) -> tuple[str | None, str | None]:
        raise NotImplementedError

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        raise NotImplementedError


class SplitReasoningParser(ReasoningParser):
    """A parser that says how a text splits, ``_split(text, final) -> (reasoning, content)``;
    the finished answer and the stream both come from it. Unless ``final``, the split leaves
    out a trailing piece that may still become a marker, so that each part only grows as text
    arrives: the stream sends what each split adds, and a stream split anywhere (even inside a
    marker) sends what the finished text's split holds. A marker's own text is never sent."""

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        self._sent_reasoning = 0  # characters of the reasoning / content streamed so far
        self._sent_content = 0

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        raise NotImplementedError

    def flush(self, current_text: str) -> DeltaMessage | None:
        """What a stream still owes once it has ended (text held back as a possible marker); an
        llmhal addition to the streaming method, which cannot know the stream's end."""
        reasoning, content = self._split(current_text, final=True)
        dm = DeltaMessage(reasoning[self._sent_reasoning :] or None, content[self._sent_content :] or None)  # fmt: skip
        self._sent_reasoning, self._sent_content = len(reasoning), len(content)
        return dm if dm.reasoning or dm.content else None

    @staticmethod
    def _partial(text: str, tag: str) -> int:
        """How many trailing characters of ``text`` could be the beginning of ``tag``."""
        for n in range(min(len(tag) - 1, len(text)), 0, -1):
            if tag.startswith(text[-n:]):
                return n
        return 0

    def extract_reasoning(
        self, model_output: str, request: Any = None
    ) -> tuple[str | None, str | None]:
        reasoning, content = self._split(model_output, final=True)
        return reasoning or None, content or None

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        reasoning, content = self._split(current_text, final=False)
        dm = DeltaMessage()
        if len(reasoning) > self._sent_reasoning:
            dm.reasoning = reasoning[self._sent_reasoning :]
            self._sent_reasoning = len(reasoning)
        if len(content) > self._sent_content:
            dm.content = content[self._sent_content :]
            self._sent_content = len(content)
        return dm if dm.reasoning or dm.content else None


class BaseThinkingReasoningParser(SplitReasoningParser):
    """Reasoning between a start and an end token (subclasses name them). Both must be single
    tokens of the vocabulary: the id-based answers depend on it.

    The text-based answers split on the tags' text, so a stream split anywhere (even inside a
    tag) gives what the finished output gives; a tag's own text is never sent. ``starts_inside``
    (DeepSeek-R1: the chat template opens ``<think>`` itself) makes text before any tag reasoning
    rather than content.
    """

    start_token: str = ""
    end_token: str = ""
    starts_inside: bool = False

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        if tokenizer is None:
            raise ValueError(f"{type(self).__name__} needs the model's tokenizer")
        if not self.start_token or not self.end_token:
            raise ValueError(f"{type(self).__name__} must name its start and end tokens")
        self.start_token_id = self._token_id(self.start_token)
        self.end_token_id = self._token_id(self.end_token)
        if self.start_token_id is None or self.end_token_id is None:
            raise RuntimeError(
                f"{type(self).__name__} needs {self.start_token!r} and {self.end_token!r} as tokens "
                "of the model's vocabulary; this tokenizer has "
                f"{'neither' if self.start_token_id is None and self.end_token_id is None else 'only one'}"
                " (is this a reasoning model?)"
            )

    def _token_id(self, token: str) -> int | None:
        """``token``'s id, or None when it is not one token of the vocabulary. Looked up alone: a
        parser is made per request and per choice, and ``self.vocab`` (the whole vocabulary as a
        dict) took ~70 ms for SmolLM2's 49k tokens each time."""
        tid = self.model_tokenizer.convert_tokens_to_ids(token)
        if not isinstance(tid, int) or self.model_tokenizer.convert_ids_to_tokens(tid) != token:
            return None  # an unknown token maps to the unknown-token id, or to None
        return tid

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        for t in reversed(input_ids):
            if t == self.start_token_id:
                return False
            if t == self.end_token_id:
                return True
        return False

    def is_reasoning_end_streaming(
        self, input_ids: Sequence[int], delta_ids: Sequence[int]
    ) -> bool:
        return self.end_token_id in delta_ids

    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        ids = list(input_ids)
        if self.end_token_id not in ids[:-1]:
            return []
        return ids[ids.index(self.end_token_id) + 1 :]

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        ids = list(token_ids)
        start = ids.index(self.start_token_id) + 1 if self.start_token_id in ids else 0
        if not self.starts_inside and self.start_token_id not in ids:
            return 0
        end = ids.index(self.end_token_id) if self.end_token_id in ids[start:] else len(ids)
        return max(0, end - start)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of ``text`` so far; unless ``final``, a trailing piece that may be
        a tag being written is left out of both, so that each only ever grows as text arrives.
        Reasoning is what lies before the end tag: from the beginning with ``starts_inside``
        (a start tag in it is dropped), else from the start tag on (text before that tag, and
        all text when there is none, is content). Text after the end tag is content."""
        end = text.find(self.end_token)
        if self.starts_inside:
            before, body = "", text if end < 0 else text[:end]
            body = body.replace(self.start_token, "", 1)
        else:
            start = text.find(self.start_token)
            if start < 0 or (0 <= end < start):  # no reasoning (yet): all content
                cut = 0 if final else self._partial(text, self.start_token)
                return "", text[: len(text) - cut]
            end = text.find(self.end_token, start)
            before, body = text[:start], text[start + len(self.start_token) : None if end < 0 else end]  # fmt: skip
        if end >= 0:
            return body, before + text[end + len(self.end_token) :]
        cut = 0
        if not final:
            cut = max(self._partial(body, self.end_token), self._partial(body, self.start_token))
        return body[: len(body) - cut], before
