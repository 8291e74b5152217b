"""The ``xgrammar`` structured-output backend (``pip install xgrammar``).

JSON schemas, the built-in JSON grammar, regexes and EBNF/GBNF grammars compile through
``xgrammar.GrammarCompiler`` (which caches compiled grammars); a choice becomes the EBNF
alternation of its strings. Lark grammars are not xgrammar's format: the guidance backend takes them.

Some JSON-schema keywords xgrammar 0.2 compiles but does not enforce: it accepted ``[1]`` for an
array that must ``contains`` 5, ``3`` for ``{"not": {"type": "integer"}}``, ``"x"`` for an
unknown ``format``, and ``"aaaa"`` for a ``pattern`` with ``maxLength: 2`` (checked with its own
matcher; ``if``/``then`` likewise); and a string with ``minLength``/``maxLength`` took raw control
characters (``"巽Η\x1e)"``), which JSON forbids, where one without them did not. A schema using them is refused here, so ``auto`` hands it to
guidance, which enforces them or says it cannot, rather than answering outside the schema.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from llmhal.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from llmhal.structured_output.params import StructuredOutputOptions
from llmhal.utils.imports import require


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_tokens(self, request_id: str, tokens: Sequence[int]) -> bool:
        return all(self.matcher.accept_token(int(t)) for t in tokens)

    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        ok: list[int] = []
        for t in tokens:
            if not self.matcher.accept_token(int(t)):
                break
            ok.append(int(t))
        if ok:
            self.matcher.rollback(len(ok))
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()


# The string formats xgrammar enforces (vLLM's list, and what it accepted and refused here).
FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})  # fmt: skip
_IGNORED_KEYWORDS = ("contains", "minContains", "maxContains", "not", "if", "then", "else")
# Keywords whose value maps names to subschemas (the names are not keywords), and keywords whose
# value is data, not a schema.
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})  # fmt: skip
_DATA = frozenset({"enum", "const", "default", "examples", "required", "dependentRequired"})


def unenforced_keywords(schema: Any) -> list[str]:
    """The schema's keywords xgrammar would ignore (see the module docstring), sorted."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        found.update(k for k in _IGNORED_KEYWORDS if k in node)
        if isinstance(node.get("format"), str) and node["format"] not in FORMATS:
            found.add(f"format {node['format']!r}")
        if "minLength" in node or "maxLength" in node:
            found.add("minLength/maxLength")
        for key, value in node.items():
            if key in _NAME_MAPS and isinstance(value, dict):
                for sub in value.values():
                    walk(sub)
            elif key not in _DATA:
                walk(value)

    walk(schema)
    return sorted(found)


def choice_ebnf(choices: Sequence[str]) -> str:
    """``root ::= "a" | "b"``: JSON string escapes are valid GBNF literal escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        xgr = require("xgrammar", purpose="the xgrammar structured-output backend")
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids or None
        )
        # The manager compiles on its own threads, a few at a time; one thread each keeps a
        # compile from taking every core away from decoding.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self._xgr = xgr

    def compile(
        self, request_type: StructuredOutputOptions, grammar_spec: str, *, compact: bool = False
    ) -> Any:
        c = self.compiler
        kind = StructuredOutputOptions
        try:
            if request_type is kind.JSON:
                ignored = unenforced_keywords(json.loads(grammar_spec))
                if ignored:
                    raise ValueError(f"xgrammar does not enforce {', '.join(ignored)}")
                compiled = c.compile_json_schema(grammar_spec, any_whitespace=not compact)
            elif request_type is kind.JSON_OBJECT:
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=not compact)
            elif request_type is kind.REGEX:
                compiled = c.compile_regex(grammar_spec)
            elif request_type is kind.CHOICE:
                compiled = c.compile_grammar(choice_ebnf(json.loads(grammar_spec)))
            else:
                compiled = c.compile_grammar(grammar_spec)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse and schema errors
            raise ValueError(
                f"xgrammar cannot compile this {request_type.value} constraint: {e}"
            ) from None
        return compiled

    def grammar(self, compiled: Any) -> StructuredOutputGrammar:
        return XgrammarGrammar(self._xgr.GrammarMatcher(compiled))

    def destroy(self) -> None:
        self.compiler.clear_cache()
