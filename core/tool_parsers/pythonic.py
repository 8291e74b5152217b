"""``pythonic``: calls written as a Python list, ``[get_weather(city='Paris', days=2), now()]``
(Llama 3.2 and others prompted for it, ToolACE), the answer's first text. Arguments are keyword
arguments with literal values (``true``/``false``/``null`` read as JSON's). A call counts once
its closing parenthesis arrives; text after the closing ``]`` is not content."""

from __future__ import annotations

import ast
from typing import Any

from llmhal.tool_parsers.base import ToolCall
from llmhal.tool_parsers.incremental import SectionToolParser, make_call

_JSON_NAMES = {"true": True, "false": False, "null": None}


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None}  # fmt: skip
    return ast.literal_eval(node)


def call_from_source(src: str) -> ToolCall:
    """One ``name(key=value, ...)`` as a call; ValueError if it is not one."""
    try:
        node = ast.parse(src.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"not a call: {src!r}") from e
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError(f"not a keyword-argument call: {src!r}")
    name = ast.unparse(node.func)  # dotted names (module.function) kept whole
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError(f"**kwargs in a call: {src!r}")
        args[kw.arg] = _value(kw.value)
    return make_call(name, args)


def list_items(text: str, start: int) -> tuple[list[str], str | None]:
    """The top-level items of the Python list opening at ``text[start]`` (``[``) that are
    complete (followed by ``,`` or the closing ``]``), and the text after the last of them when
    the list has not closed yet (None once it has). Strings and brackets are followed so that
    commas inside them do not split."""
    items, depth, quote, i, item_start = [], 0, "", start + 1, start + 1
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif text.startswith(quote, i):
                i += len(quote) - 1
                quote = ""
        elif c in "'\"":
            quote = c * 3 if text.startswith(c * 3, i) else c
            i += len(quote) - 1
        elif c in "([{":
            depth += 1
        elif c in ")}]" and depth:
            depth -= 1
        elif c in ",]" and not depth:
            if text[item_start:i].strip():
                items.append(text[item_start:i])
            if c == "]":
                return items, None
            item_start = i + 1
        i += 1
    return items, text[item_start:]


class PythonicToolParser(SectionToolParser):
    markers = ("[",)
    at_start = True

    def calls(self, section: str, request: dict[str, Any], final: bool) -> list[ToolCall]:
        items, tail = list_items(section, section.find("["))
        if final and tail is not None and tail.strip().endswith(")"):
            items.append(tail)  # cut short after a whole call
        out = []
        for src in items:
            try:
                out.append(call_from_source(src))
            except ValueError:
                continue  # a malformed item is skipped
        return out
