"""The ``outlines`` structured-output backend (``pip install outlines-core``), as vLLM's.

Every constraint becomes a regular expression (a JSON schema through outlines-core's
``build_regex_from_schema``, a choice as the alternation of its escaped strings) and the regex an
``Index``: for each state of its automaton, the tokens that keep the output inside it. A request
walks its own ``Guide`` over the shared index, which writes each step's mask straight into the
bitmask row. Building the index is the slow part (it visits the whole vocabulary per state: a
large schema takes seconds), which is what the manager caches and compiles off the engine's path:
in a compile process (:mod:`llmhal.structured_output.compile_worker`), whose answer is the
index's own binary form.

Grammars (EBNF, Lark) are not regular and are refused; ``json_object`` is an object of
strings, numbers, booleans and nulls, not nested (see ``_FLAT_OBJECT``). outlines-core turns a schema into a regex
without enforcing ``minimum``/``maximum``, ``multipleOf``, ``uniqueItems``, ``minProperties``,
``patternProperties`` or a ``pattern`` beside a length (it kept only the length), so a schema
using them is refused here, naming them, rather than answered outside the schema.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from llmhal.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from llmhal.structured_output.compile_pool import ConstraintRefused
from llmhal.structured_output.params import StructuredOutputOptions
from llmhal.structured_output.schema_checks import keywords_outside
from llmhal.structured_output.vocab import token_bytes
from llmhal.utils.imports import require

# What outlines-core's schema-to-regex conversion enforces (checked against jsonschema here).
SUPPORTED = frozenset({
    "type", "properties", "required", "additionalProperties", "enum", "const", "anyOf", "oneOf",
    "allOf", "$ref", "items", "prefixItems", "minItems", "maxItems", "minLength", "maxLength",
    "pattern", "format",
})  # fmt: skip
FORMATS = frozenset({"date-time", "date", "time", "uuid", "uri", "email"})
# json_object: an object of strings, numbers, booleans and nulls. The regex of any JSON object
# (nested to outlines-core's depth) took 32 s to index on a 384-token vocabulary; this one 25 ms.
_FLAT_OBJECT = {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean", "null"]}}  # fmt: skip
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def escape(text: str) -> str:
    """``text`` as a literal in outlines-core's (Rust) regex syntax."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def schema_regex(json_schema: Any, spec: str, compact: bool) -> str:
    oc_json = require("outlines_core.json_schema", package="outlines-core", purpose="the outlines backend")  # fmt: skip
    ignored = keywords_outside(json_schema, SUPPORTED, FORMATS, length_with_pattern=False)
    if ignored:
        raise ValueError(f"outlines does not enforce {', '.join(ignored)}")
    # outlines-core's default whitespace is one optional space; compact allows none.
    try:
        return oc_json.build_regex_from_schema(spec, "" if compact else None)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"outlines cannot read this JSON schema: {e}") from None


class OutlinesGrammar(StructuredOutputGrammar):
    """A Guide over a shared index. The Guide has no step for EOS: a stop token is accepted here
    where the guide is in a final state, and ends the grammar."""

    def __init__(self, guide: Any, stop_ids: frozenset[int], eos: int) -> None:
        self.guide = guide
        self.stop_ids = stop_ids
        self.eos = eos
        self._stopped = False
        self._advanced = 0  # tokens the guide has advanced over (for rollback)

    def _step(self, token: int) -> bool:
        if self._stopped:
            return False
        if token in self.stop_ids:
            self._stopped = self.guide.is_finished()
            return self._stopped
        if not self.guide.accepts_tokens([token]):
            return False
        self.guide.advance(token, return_tokens=False)
        self._advanced += 1
        return True

    def accept_tokens(self, request_id: str, tokens: Sequence[int]) -> bool:
        return all(self._step(int(t)) for t in tokens)

    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        ok: list[int] = []
        for t in tokens:
            if not self._step(int(t)):
                break
            ok.append(int(t))
        self.rollback(len(ok))
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and self._stopped:
            self._stopped = False
            num_tokens -= 1
        if num_tokens > 0:
            self.guide.rollback_state(num_tokens)
            self._advanced -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        row = bitmask[index]
        self.guide.write_mask_into(row.data_ptr(), row.numel(), row.element_size())
        if self.guide.is_finished():  # the guide knows one EOS; the model may have several
            for t in self.stop_ids:
                if t < row.numel() * 32:
                    row[t // 32] |= _bit(t)

    def is_terminated(self) -> bool:
        return self._stopped

    def reset(self) -> None:
        self.guide.reset()
        self._stopped = False
        self._advanced = 0


def _bit(token: int) -> torch.Tensor:
    return torch.tensor(1 << (token % 32), dtype=torch.int64).to(torch.int32)


class OutlinesBackend(StructuredOutputBackend):
    name = "outlines"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        self._oc = require("outlines_core", package="outlines-core", purpose="the outlines structured-output backend")  # fmt: skip
        if not self.stop_token_ids:
            raise ValueError("the outlines backend needs the model's EOS token id; it has none")
        self.eos = self.stop_token_ids[0]
        by_bytes: dict[bytes, list[int]] = {}
        for i, raw in token_bytes(tokenizer, vocab_size).items():
            if i not in self.stop_token_ids:
                by_bytes.setdefault(raw, []).append(i)
        self.vocabulary = self._oc.Vocabulary(self.eos, by_bytes)
        # (key, outlines-core's binary form of the vocabulary), made for the first compile
        # process; each worker gets it once.
        self._vocabulary_binary: tuple[str, bytes] | None = None

    def compile(self, request_type: StructuredOutputOptions, grammar_spec: str, *, compact: bool = False) -> Any:  # fmt: skip
        kind = StructuredOutputOptions
        if request_type is kind.JSON:
            regex = schema_regex(json.loads(grammar_spec), grammar_spec, compact)
        elif request_type is kind.JSON_OBJECT:
            regex = schema_regex(_FLAT_OBJECT, json.dumps(_FLAT_OBJECT), compact)
        elif request_type is kind.REGEX:
            regex = grammar_spec
        elif request_type is kind.CHOICE:
            regex = "(" + "|".join(escape(c) for c in json.loads(grammar_spec)) + ")"
        else:
            raise ValueError("outlines takes JSON schemas, regexes and choices, not grammars; use the xgrammar or guidance backend")  # fmt: skip
        if self.processes is None:  # compiling on the caller's thread (async_compile=False)
            try:
                return self._oc.Index(regex, self.vocabulary)
            except (ValueError, TypeError, RuntimeError) as e:
                raise ValueError(f"outlines cannot compile this {request_type.value} constraint: {e}") from None  # fmt: skip
        # In a compile process: building the index here slowed every running stream's steps
        # (5x on average next to a 4-email schema); reading its binary form back is one pass.
        if self._vocabulary_binary is None:
            self._vocabulary_binary = (uuid.uuid4().hex, self.vocabulary.__reduce__()[1][0])
        try:
            _, raw = self.processes.call({"op": "outlines_index", "key": self._vocabulary_binary[0], "regex": regex}, vocabulary=self._vocabulary_binary)  # fmt: skip
        except ConstraintRefused as e:
            raise ValueError(f"outlines cannot compile this {request_type.value} constraint: {e}") from None  # fmt: skip
        # Here, on the compile thread: the request waits in its own state. outlines-core holds
        # the GIL for the whole read (it never releases it: 69 ms for a 7.4 MB index, 0.29 s for
        # 93 MB), so the engine's Python pauses that long once per index whichever thread reads.
        return self._oc.Index.from_binary(raw)

    def grammar(self, compiled: Any) -> StructuredOutputGrammar:
        return OutlinesGrammar(self._oc.Guide(compiled), frozenset(self.stop_token_ids), self.eos)
