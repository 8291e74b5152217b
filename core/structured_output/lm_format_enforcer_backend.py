"""The ``lm-format-enforcer`` structured-output backend (``pip install lm-format-enforcer``), as
vLLM's.

It uses the library's core, not its transformers integration (which imports modules transformers
5 no longer has): a character-level parser (``JsonSchemaParser``, ``RegexParser``, or a union of
``StringParser`` for a choice) walked over a prefix tree of the vocabulary by a
``TokenEnforcer``, which returns each step's allowed tokens as a bitmask in vLLM's format. The
tokenizer's tree is built once per engine (0.9 s for a 49k vocabulary: pure Python). A constraint's
regular expressions (a regex, a schema's patterns) become automata once, in a compile process
(interegular, the library's regex engine, is pure Python and held the GIL for seconds on the
engine's compile thread), shared by the requests that ask for it; each request gets its own
parser over them.

Grammars are refused. A character the vocabulary has only as bytes spread over several tokens
(rare symbols, most emoji, on byte-level BPE vocabularies) cannot be generated. Its JSON parser does not enforce ``minimum``/``maximum``, ``format``,
``multipleOf``, ``uniqueItems``, ``prefixItems``, ``patternProperties``, string lengths, the
``integer`` type and others (see ``SUPPORTED``): a schema using them is refused, naming them. Properties come in the order of the
schema's ``required`` list (the library's ``force_json_field_order``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from llmhal.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from llmhal.structured_output.compile_pool import ConstraintRefused
from llmhal.structured_output.params import StructuredOutputOptions
from llmhal.structured_output.schema_checks import keywords_outside
from llmhal.structured_output.vocab import special_token_ids
from llmhal.utils.imports import require

# What the library's JSON-schema parser reads (its jsonschemaparser module), checked against
# jsonschema here.
SUPPORTED = frozenset({
    "type", "properties", "required", "additionalProperties", "enum", "const", "anyOf", "oneOf",
    "allOf", "$ref", "items", "minItems", "maxItems", "pattern",
})  # fmt: skip
_CONTROL = re.compile("[\x00-\x1f\x7f]")
# Its "integer" takes an exponent, signed too ('1E-5', not an integer; a long one overflowed to
# infinity): such schemas are refused.
_LOOSE_TYPES = frozenset({"integer"})
# Not minLength/maxLength: its parser does not count a string's leading whitespace (it took
# '" Ber8f"' for maxLength 5), so an output could break them.


class LMFormatEnforcerGrammar(StructuredOutputGrammar):
    """The output so far, and the request's TokenEnforcer (which caches its states by it)."""

    def __init__(self, enforcer: Any, stop_ids: frozenset[int]) -> None:
        self.enforcer = enforcer
        self.stop_ids = stop_ids
        self.tokens: list[int] = []
        self._stopped = False

    def _allowed(self, prefix: list[int]) -> torch.Tensor:
        return self.enforcer.get_allowed_tokens(prefix).allowed_tokens

    def _allows(self, prefix: list[int], token: int) -> bool:
        words = self._allowed(prefix)
        return token >> 5 < words.numel() and (int(words[token >> 5]) >> (token & 31)) & 1 == 1

    def _can_end(self) -> bool:
        state = self.enforcer.prefix_states.get(tuple(self.tokens))
        return state is None or state.parser.can_end()

    def accept_tokens(self, request_id: str, tokens: Sequence[int]) -> bool:
        for t in map(int, tokens):
            if self._stopped or not self._allows(self.tokens, t):
                return False
            if t in self.stop_ids and not self._can_end():
                # The library allows EOS anywhere after an internal error ("Terminating the
                # parser"): an output it cannot end is not complete.
                return False
            self.tokens.append(t)
            self._stopped = t in self.stop_ids
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        prefix, ok = list(self.tokens), []
        stopped = self._stopped
        for t in map(int, tokens):
            if stopped or not self._allows(prefix, t):
                break
            prefix.append(t)
            ok.append(t)
            stopped = t in self.stop_ids
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            del self.tokens[-num_tokens:]
            self._stopped = False

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        words = self._allowed(self.tokens)
        row = bitmask[index]
        row.zero_()
        n = min(row.numel(), words.numel())
        row[:n] = words[:n]

    def is_terminated(self) -> bool:
        return self._stopped

    def reset(self) -> None:
        self.tokens.clear()
        self._stopped = False


def regular_tokens(tokenizer: Any, vocab_size: int) -> list[tuple[int, str, bool]]:
    """(id, text, starts a word) for every regular token, the way the library's own integrations
    compute them: a token starts a word when decoding it after another token adds a space that
    decoding it alone drops (SentencePiece's ``▁``). Tokens holding part of a UTF-8 character are
    left out: the library reads each as one U+FFFD character and let a string take it, then the
    next token made it two characters or invalid text (seen on byte-level BPE vocabularies: a
    ``maxLength`` string overran and the output ended mid-string). So are tokens with control
    characters, newlines and tabs included: its JSON strings took them raw, which JSON forbids
    (its JSON whitespace is then spaces only)."""
    special = special_token_ids(tokenizer)
    zero = tokenizer.encode("0", add_special_tokens=False)[-1]
    lead = len(tokenizer.decode([zero]))
    out = []
    for i in range(min(vocab_size, len(tokenizer))):
        if i in special:
            continue
        after = tokenizer.decode([zero, i])[lead:]
        if "\ufffd" in after or _CONTROL.search(after):
            continue
        out.append((i, after, len(after) > len(tokenizer.decode([i]))))
    return out


# Keywords whose values are JSON data, not schemas (a "pattern" in them is no pattern), and those
# whose values map names to schemas (a property may be called "pattern" or "enum").
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
_NAMED_SCHEMAS = frozenset({"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"})  # fmt: skip


def schema_patterns(schema: Any) -> list[str]:
    """Every ``pattern`` of a JSON schema, as the library's string parser keys them (one leading
    ``^`` and one trailing ``$`` dropped: it matches whole strings anyway)."""
    out: list[str] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            p = node.get("pattern")
            if isinstance(p, str):
                p = p[1:] if p.startswith("^") else p
                out.append(p[:-1] if p.endswith("$") else p)
            for k, v in node.items():
                if k in _NAMED_SCHEMAS and isinstance(v, dict):
                    stack.extend(v.values())
                elif k not in _DATA_KEYWORDS:
                    stack.append(v)
    return out


class LMFormatEnforcerBackend(StructuredOutputBackend):
    name = "lm-format-enforcer"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        lmfe = require("lmformatenforcer", package="lm-format-enforcer", purpose="the lm-format-enforcer structured-output backend")  # fmt: skip
        if not self.stop_token_ids:
            raise ValueError("the lm-format-enforcer backend needs the model's EOS token id; it has none")  # fmt: skip

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids).rstrip("\ufffd")  # a partial character is not text yet

        self.data = lmfe.TokenEnforcerTokenizerData(
            regular_tokens(tokenizer, vocab_size), decode, list(self.stop_token_ids),
            use_bitmask=True, vocab_size=vocab_size,
        )  # fmt: skip
        self._lmfe = lmfe

    def compile(
        self, request_type: StructuredOutputOptions, grammar_spec: str, *, compact: bool = False
    ) -> tuple[Callable[[], Any], bool]:
        """(a parser factory, compact): the parser is made once here to check the constraint.
        Regular expressions (a regex constraint, a schema's ``pattern``) become automata here,
        once per constraint, not per request or mid-decoding as the library would."""
        lmfe = self._lmfe
        kind = StructuredOutputOptions
        if request_type is kind.JSON:
            schema = json.loads(grammar_spec)
            ignored = keywords_outside(
                schema, SUPPORTED, frozenset(), unenforced_types=_LOOSE_TYPES
            )
            if ignored:
                raise ValueError(f"lm-format-enforcer does not enforce {', '.join(ignored)}")
            self._seed_patterns(schema_patterns(schema))
            make = lambda: lmfe.JsonSchemaParser(schema)  # noqa: E731
        elif request_type is kind.JSON_OBJECT:
            make = lambda: lmfe.JsonSchemaParser({"type": "object"})  # noqa: E731
        elif request_type is kind.REGEX:
            (context,) = self._regex_contexts([grammar_spec])
            make = lambda: lmfe.RegexParser(context)  # noqa: E731
        elif request_type is kind.CHOICE:
            choices = json.loads(grammar_spec)
            make = lambda: lmfe.UnionParser([lmfe.StringParser(c) for c in choices])  # noqa: E731
        else:
            raise ValueError("lm-format-enforcer takes JSON schemas, regexes and choices, not grammars; use the xgrammar or guidance backend")  # fmt: skip
        try:
            make()  # reads the schema now: a bad one fails its own request, here
        except Exception as e:  # pydantic's and interegular's errors have no common base
            raise ValueError(f"lm-format-enforcer cannot read this {request_type.value} constraint: {e}") from None  # fmt: skip

        return make, compact

    def _regex_contexts(self, patterns: list[str]) -> list[Any]:
        """A RegexParser context (its automaton, shared by the requests) per pattern; the
        automata are built in a compile process when the manager has them (interegular is pure
        Python: building one here would hold the GIL for as long)."""
        from llmhal.structured_output.compile_worker import fsm_from_json, regex_fsm

        if self.processes is None:
            fsms = []
            for p in patterns:
                try:
                    fsms.append(regex_fsm(p))
                except Exception as e:  # interegular's parse errors have no common base
                    raise ValueError(f"lm-format-enforcer cannot read the regular expression {p!r}: {e}") from None  # fmt: skip
        else:
            try:
                _, raw = self.processes.call({"op": "regex_fsms", "patterns": patterns})
            except ConstraintRefused as e:
                raise ValueError(f"lm-format-enforcer cannot read the regular expression {e}") from None  # fmt: skip
            fsms = [fsm_from_json(f) for f in json.loads(raw)]
        contexts = []
        for fsm in fsms:
            context = self._lmfe.RegexParser._Context()
            context.pattern = fsm
            context.state_character_cache = {}
            contexts.append(context)
            # What RegexParser's config setter computes for the tokenizer's alphabet (the
            # TokenEnforcer sets it again on a root parser, to the same value).
            self._lmfe.RegexParser(context)._update_alphabet(self.data.tokenizer_alphabet)
        return contexts

    def _config(self) -> Any:
        return self._lmfe.CharacterLevelParserConfig(alphabet=self.data.tokenizer_alphabet)

    def _seed_patterns(self, patterns: list[str]) -> None:
        """Put the schema's patterns' parsers in the library's cache (one per process, keyed by
        pattern), where its JSON parser would otherwise build them on the engine's thread when a
        string with a pattern begins."""
        cache = self._lmfe.JsonSchemaParser._Context.regex_parser_cache
        todo = [p for p in dict.fromkeys(patterns) if p not in cache]
        if todo:
            for p, context in zip(todo, self._regex_contexts(todo), strict=True):
                cache.setdefault(p, self._lmfe.RegexParser(context, self._config()))

    def grammar(self, compiled: tuple[Callable[[], Any], bool]) -> StructuredOutputGrammar:
        make, compact = compiled
        parser = make()  # parsers keep per-request state: one each
        enforcer = self._lmfe.TokenEnforcer(self.data, parser)
        # The enforcer gives the parser a fresh config (its alphabet); the rest is set on it.
        parser.config.force_json_field_order = True
        if compact:
            parser.config.max_consecutive_whitespaces = 0
        return LMFormatEnforcerGrammar(enforcer, frozenset(self.stop_token_ids))
