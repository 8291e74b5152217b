"""Shared readings of call bodies: JSON call objects in a row or in a list, and parameter values
written as text (XML-style formats), typed by the request's tool schema."""

from __future__ import annotations

import ast
import json
from typing import Any

from llmhal.tool_parsers.base import ToolCall
from llmhal.tool_parsers.incremental import make_call

_DECODER = json.JSONDecoder()


def json_objects(text: str, pos: int = 0, separators: str = ",;") -> tuple[list[Any], int, bool]:
    """The JSON values written one after another from ``pos`` (whitespace and ``separators``
    between them): (values, where reading stopped, whether it stopped at text that is not JSON
    rather than at the end or at an unfinished value)."""
    values: list[Any] = []
    n = len(text)
    while True:
        while pos < n and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= n or text[pos] not in "{[":
            return values, pos, pos < n
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            return values, pos, False  # unfinished (or malformed: the reading stops there)
        values.append(value)
        pos = end


def call_from_object(
    obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")
) -> ToolCall:
    """``{"name": ..., "arguments"|"parameters": {...}}`` as a call; ValueError otherwise."""
    if not isinstance(obj, dict):
        raise ValueError(f"not a call object: {obj!r}")
    args = next((obj[k] for k in args_keys if k in obj), {})
    return make_call(obj.get("name"), args)


def calls_from_objects(objs: list[Any], args_keys: tuple[str, ...] = ("arguments", "parameters")) -> list[ToolCall]:  # fmt: skip
    """The call objects among ``objs`` (malformed ones skipped)."""
    out = []
    for obj in objs:
        try:
            out.append(call_from_object(obj, args_keys))
        except ValueError:
            continue
    return out


def json_list_calls(text: str, pos: int = 0, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> list[ToolCall]:  # fmt: skip
    """The calls of a JSON list ``[{...}, {...}]`` starting at ``pos`` (after whitespace), read
    object by object, so the closed ones count before the list closes."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if not text.startswith("[", pos):
        return []
    objs, _, _ = json_objects(text, pos + 1, separators=",")
    return calls_from_objects(objs, args_keys)


def param_types(request: dict[str, Any], function: str) -> dict[str, Any]:
    """parameter name -> JSON schema ``type`` of ``function`` in the request's tools."""
    tools = request.get("tools") if isinstance(request, dict) else getattr(request, "tools", None)
    for tool in tools or []:
        tool = tool.model_dump() if hasattr(tool, "model_dump") else tool  # a request object's
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == function:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


def typed_value(raw: str, schema_type: Any) -> Any:
    """A parameter value written as text, as its schema's type: strings stay as written; other
    types (and parameters the schema does not name) are read as JSON, then as a Python literal,
    else kept as text."""
    if schema_type == "string" or (isinstance(schema_type, list) and "string" in schema_type and "null" not in schema_type):  # fmt: skip
        return raw
    for read in (json.loads, ast.literal_eval):
        try:
            return read(raw)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return raw


def calls_from_matches(matches: Any) -> list[ToolCall]:
    """Calls from regex matches with ``name`` and ``args`` groups (and an ``id`` group, when the
    format carries the call's id); malformed ones skipped."""
    out = []
    for m in matches:
        groups = m.groupdict()
        try:
            out.append(make_call(groups["name"], groups["args"], groups.get("id")))
        except ValueError:
            continue
    return out


def typed_calls(found: list[tuple[str, list[tuple[str, str]]]], request: dict[str, Any]) -> list[ToolCall]:  # fmt: skip
    """Calls from (name, [(parameter, value text), ...]) of XML-style formats, each value typed
    by the function's schema in the request (:func:`typed_value`); malformed ones skipped."""
    out = []
    for name, pairs in found:
        types = param_types(request, name.strip())
        args = {k.strip(): typed_value(v, types.get(k.strip())) for k, v in pairs}
        try:
            out.append(make_call(name, args))
        except ValueError:
            continue
    return out
