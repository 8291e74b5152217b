"""Checks on a JSON schema that every backend needs before it compiles it.

A schema whose ``$ref`` chain never reaches a value (``{"$ref": "#"}``, two definitions pointing
at each other, an object that requires a property whose schema is the object itself) has no
finite instance. The backends disagree on it: xgrammar refuses a bare loop, but llguidance
compiled it to a grammar that was complete before any token, so the request answered 200 with
empty text and ``finish_reason: "stop"``; and a required self-reference compiled everywhere and
generated until ``max_tokens``. Such a schema is refused here, naming the loop, like any other
invalid schema.
"""

from __future__ import annotations

from typing import Any

# Keywords whose schemas an instance must satisfy all of; those where one branch is enough.
_ALL_OF = ("allOf",)
_ANY_OF = ("anyOf", "oneOf")


def unsatisfiable_ref_loop(schema: Any) -> str | None:
    """The ``$ref`` loop that leaves ``schema`` with no finite instance, written as
    ``"#/$defs/a -> #/$defs/a"``; None when it has one (as far as references go: conflicting
    keywords without a loop are the backends' business)."""
    loops: list[list[str]] = []
    ok = _Walk(schema, loops).productive(schema, ())
    if ok or not loops:
        return None
    return " -> ".join(loops[0])


def _resolve(root: Any, ref: str) -> tuple[bool, Any]:
    """(found, target) of a local ``$ref`` (``#`` or a JSON pointer into the root)."""
    if not ref.startswith("#"):
        return False, None  # remote or anchor-style: not ours to follow
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False, None
    return True, node


class _Walk:
    def __init__(self, root: Any, loops: list[list[str]]) -> None:
        self.root = root
        self.loops = loops
        # References known to have an instance (true on any path; a False found under a path
        # cut-off is not, so only these are kept): schemas that use one definition many times
        # stay linear.
        self.good: set[str] = set()

    def productive(self, node: Any, path: tuple[str, ...]) -> bool:
        """Whether ``node`` has a finite instance, following ``$ref`` depth first; a reference
        back into ``path`` (the references being followed) counts as none, which is exact for
        these monotone rules: a finite instance never needs a reference inside itself."""
        if node is False:
            return False
        if not isinstance(node, dict):
            return True
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in self.good:
            if ref in path:
                self.loops.append([*path[path.index(ref) :], ref])
                return False
            found, target = _resolve(self.root, ref)
            if found:
                if not self.productive(target, (*path, ref)):
                    return False
                self.good.add(ref)
        return self._members(node, path)

    def _members(self, node: dict[str, Any], path: tuple[str, ...]) -> bool:
        """The rest of ``node``: the subschemas every instance must satisfy."""
        ok = self.productive
        for key in _ALL_OF:
            if isinstance(node.get(key), list) and not all(ok(s, path) for s in node[key]):
                return False
        for key in _ANY_OF:
            if isinstance(node.get(key), list) and node[key]:
                if not any(ok(s, path) for s in node[key]):
                    return False
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        for name in node.get("required") or ():
            if isinstance(name, str) and name in props and not ok(props[name], path):
                return False
        min_items = node.get("minItems")
        if isinstance(min_items, int) and min_items > 0:
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            if not all(ok(s, path) for s in prefix[:min_items]):
                return False
            if min_items > len(prefix) and "items" in node and not ok(node["items"], path):
                return False
        return True


# Keywords that describe a schema without constraining its instances.
ANNOTATIONS = frozenset({
    "title", "description", "$schema", "$id", "$comment", "default", "examples", "deprecated",
    "readOnly", "writeOnly", "$defs", "definitions",
})  # fmt: skip
# Keywords whose value maps names to subschemas; those whose value is one subschema or a list.
_NAMED_SUBSCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})  # fmt: skip
_SUBSCHEMA = frozenset({"items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems"})  # fmt: skip
_SUBSCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})


def keywords_outside(
    schema: Any,
    supported: frozenset[str],
    formats: frozenset[str],
    *,
    length_with_pattern: bool = True,
    unenforced_types: frozenset[str] = frozenset(),
) -> list[str]:
    """The keywords of ``schema`` (at any depth, where they are keywords) outside ``supported``,
    and any ``format`` outside ``formats``, sorted: what a backend would silently ignore.
    ``length_with_pattern`` False: a length beside a ``pattern`` is one of them (the backend
    keeps only one of the two). ``unenforced_types``: values of ``type`` the backend lets
    other values through for."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if not isinstance(node, dict):
            return
        if not length_with_pattern and "pattern" in node and {"minLength", "maxLength"} & set(node):
            found.add("minLength/maxLength with pattern")
        for key, value in node.items():
            if key == "type":
                types = value if isinstance(value, list) else [value]
                found.update(f"type {t!r}" for t in types if t in unenforced_types)
            elif key == "format":
                if key not in supported or value not in formats:
                    found.add(f"format {value!r}")
            elif key not in supported and key not in ANNOTATIONS:
                found.add(key)
            if key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
                for sub in value.values():
                    walk(sub)
            elif key in _SUBSCHEMA:
                walk(value)
            elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
                for sub in value:
                    walk(sub)

    walk(schema)
    return sorted(found)
