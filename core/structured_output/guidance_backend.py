"""The ``guidance`` structured-output backend (``pip install llguidance``).

llguidance takes JSON schemas (with features xgrammar refuses, e.g. ``patternProperties``),
regexes, choices and grammars in Lark or GBNF syntax. Its compile is the matcher's construction
(the grammar's lexer and parser: 0.18 s of CPU for a 1000-property schema of emails); the token
masks it builds lazily, as decoding reaches them. So the compile step makes one matcher per
constraint, which the manager caches and never advances, and each request gets a ``deep_copy`` of
it (64 us for that schema, against 0.18 s for a new matcher; the compiled grammar is shared).

llguidance gives Python's lock back for the whole construction and takes it once at the end (a
breakpoint on CPython's ``take_gil`` fired once per matcher), so on the manager's compile thread,
below the engine's priority, it competes with decoding for a core only, as xgrammar does; a
compile process would gain nothing, since a matcher cannot cross to another process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from llmhal.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from llmhal.structured_output.params import StructuredOutputOptions
from llmhal.utils.imports import require


class GuidanceGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: Any, fill: Any) -> None:
        self.matcher = matcher
        self._fill = fill

    def accept_tokens(self, request_id: str, tokens: Sequence[int]) -> bool:
        return bool(self.matcher.consume_tokens([int(t) for t in tokens]))

    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        n = self.matcher.validate_tokens([int(t) for t in tokens])
        return [int(t) for t in tokens[:n]]

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self._fill(self.matcher, bitmask, index)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def reset(self) -> None:
        self.matcher.reset()


class GuidanceBackend(StructuredOutputBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        llg = require("llguidance", purpose="the guidance structured-output backend")
        require("llguidance.hf", package="llguidance", purpose="the guidance backend")
        torch_fill = require(
            "llguidance.torch", package="llguidance", purpose="the guidance backend"
        )
        eos = self.stop_token_ids or None
        self.ll_tokenizer = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._llg = llg
        self._fill = torch_fill.fill_next_token_bitmask

    def compile(
        self, request_type: StructuredOutputOptions, grammar_spec: str, *, compact: bool = False
    ) -> Any:
        llg = self._llg
        kind = StructuredOutputOptions
        defaults = {"whitespace_flexible": not compact}
        try:
            if request_type is kind.JSON:
                grammar = llg.LLMatcher.grammar_from_json_schema(grammar_spec, defaults=defaults)
            elif request_type is kind.JSON_OBJECT:
                grammar = llg.LLMatcher.grammar_from_json_schema(
                    '{"type": "object"}', defaults=defaults
                )
            elif request_type is kind.REGEX:
                grammar = llg.grammar_from("regex", grammar_spec)
            elif request_type is kind.CHOICE:
                grammar = llg.grammar_from("choice", grammar_spec)
            else:
                grammar = llg.grammar_from("grammar", grammar_spec)
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(f"llguidance cannot read this {request_type.value} constraint: {e}") from None  # fmt: skip
        matcher = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(
                f"llguidance cannot compile this {request_type.value} constraint: "
                f"{matcher.get_error()}"
            )
        return matcher  # the prototype: copied per request, never advanced itself

    def grammar(self, compiled: Any) -> StructuredOutputGrammar:
        return GuidanceGrammar(compiled.deep_copy(), self._fill)
