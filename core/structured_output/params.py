"""What a request asks its output to follow: vLLM's ``StructuredOutputsParams`` and its key.

Exactly one constraint is set: ``json`` (a JSON schema, as a dict or its text), ``json_object``
(any JSON object), ``regex``, ``choice`` (one of these strings), or ``grammar`` (an EBNF/GBNF
grammar; the guidance backend also takes Lark). ``disable_any_whitespace`` keeps JSON output to
the compact form (small models otherwise tend to fill it with whitespace). vLLM's
``structural_tag`` and ``whitespace_pattern`` are not supported and are refused by name.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputOptions(enum.Enum):
    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(
                "You can only use one kind of structured outputs constraint but multiple are "
                f"specified: {', '.join(given)}"
            )
        if not given:
            raise ValueError(
                f"You must use one kind of structured outputs constraint ({', '.join(_KINDS)}) "
                "but none are specified"
            )
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("json_object must be True if set")
        if self.json is not None:
            if isinstance(self.json, str):
                if not self.json.strip():
                    raise ValueError("the json schema cannot be an empty string")
                try:
                    json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"the json schema is not valid JSON: {e}") from None
            elif not isinstance(self.json, dict):
                raise ValueError(f"json must be a schema (dict or JSON text), got {self.json!r}")
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError("regex must be a non-empty string")
            if "\0" in self.regex:
                raise ValueError("regex must not contain a NUL character")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, list | tuple):
                raise ValueError(f"choice must be a list of strings, got {self.choice!r}")
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):  # fmt: skip
            raise ValueError("the grammar cannot be an empty string")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("disable_any_whitespace must be True or False")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutputsParams:
        """From a request body's ``structured_outputs`` object (unknown keys named)."""
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs must be an object, got {d!r}")
        unknown = sorted(set(d) - {*_KINDS, "disable_any_whitespace"})
        if unknown:
            raise ValueError(f"structured_outputs does not support: {', '.join(unknown)}")
        return cls(**d)

    def key(self) -> tuple[StructuredOutputOptions, str]:
        """(kind, spec text): what a backend compiles, and the compiled grammars' cache key."""
        if self.json is not None:
            # Not sort_keys: the backends generate properties in the schema's order.
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return StructuredOutputOptions.JSON, spec
        if self.json_object:
            return StructuredOutputOptions.JSON_OBJECT, ""
        if self.regex is not None:
            return StructuredOutputOptions.REGEX, self.regex
        if self.choice is not None:
            return StructuredOutputOptions.CHOICE, json.dumps(list(self.choice))
        return StructuredOutputOptions.GRAMMAR, self.grammar  # type: ignore[return-value]
