"""Tool calling for ``/v1/chat/completions``: OpenAI's ``tools`` and ``tool_choice``, as vLLM serves them.

* ``tools`` go to the chat template (a model whose template ignores them sees only the messages).
* ``tool_choice: "none"`` answers in text.
* A named function (``{"type": "function", "function": {"name": ...}}``) constrains the output to
  that function's ``parameters`` schema (structured outputs, compact JSON: a small model otherwise
  spends its tokens on whitespace), so any model produces a valid call;
  the answer's ``tool_calls`` holds it, ``content`` is empty.
* ``"required"`` constrains the output to a JSON list of ``{"name", "parameters"}`` objects, one of
  the tools each, and at least one; each becomes a call (finish_reason ``tool_calls``).
* ``"auto"`` (the default with tools) lets the model choose, and a tool-call parser reads its
  calls from the text; it needs ``llmhal serve --enable-auto-tool-choice --tool-call-parser NAME``
  (vLLM's rule), else the request is refused.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmhal.entrypoints.openai_protocol import BadRequest
from llmhal.structured_output.params import StructuredOutputsParams
from llmhal.tool_parsers.base import DeltaToolCall, FunctionCall, ToolCall, ToolParser

AUTO_NEEDS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """name -> function object of OpenAI's ``tools`` list, checked."""
    if not isinstance(tools, list) or not tools:
        raise BadRequest("tools must be a non-empty list of {type: function, function: {...}}")
    out = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(
                f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}"
            )
        params = fn.get("parameters") or {"type": "object", "properties": {}}  # null: none (vLLM)
        if not isinstance(params, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object")
        if fn["name"] in out:
            raise BadRequest(f"tools[{i}] repeats the function name {fn['name']!r}")
        out[fn["name"]] = {**fn, "parameters": params}
    return out


@dataclass
class ToolPlan:
    mode: str  # "none", "auto", "named" or "required"
    tools: list[dict[str, Any]]
    functions: dict[str, dict[str, Any]]
    name: str | None = None  # the named function
    parser_cls: type[ToolParser] | None = None
    tokenizer: Any = None
    structured: StructuredOutputsParams | None = field(default=None)

    def parser(self) -> ToolParser | None:
        return self.parser_cls(self.tokenizer) if self.parser_cls is not None else None

    def final(self, text: str, finish: str | None, body: dict[str, Any], ids: Sequence[int] | None = None) -> tuple[str | None, list[ToolCall], str | None]:  # fmt: skip
        """(content, calls, finish_reason) of a finished choice; ``ids``, the text's token ids,
        go to a parser that reads them (only markers produced as tokens open calls)."""
        if self.mode == "named":
            return "", [ToolCall(FunctionCall(self.name, text))], finish  # type: ignore[arg-type]
        if self.mode == "required":
            calls = _required_calls(text)
            if not calls:  # cut short (max_tokens) before the list closed: the text as it is
                return text, [], finish
            return "", calls, "tool_calls" if finish == "stop" else finish
        if self.mode == "auto":
            parser = self.parser()
            if ids is not None and _reads_ids(type(parser)):
                info = parser.extract_tool_calls(text, body, token_ids=ids)  # type: ignore[union-attr,call-arg]
            else:
                info = parser.extract_tool_calls(text, body)  # type: ignore[union-attr]
            if info.tools_called:
                return info.content, info.tool_calls, "tool_calls" if finish == "stop" else finish
            # no call: the parser's content (gpt-oss's harmony text is its final channel's)
            return (text if info.content is None else info.content), [], finish
        return text, [], finish


def _required_calls(text: str) -> list[ToolCall]:
    """The calls of a "required" answer (a JSON list of {name, parameters}); none if the output
    was cut short (max_tokens) before the list closed."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [
        ToolCall(FunctionCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)))
        for c in items
    ]


@functools.cache
def _reads_ids(parser_cls: type[ToolParser]) -> bool:
    """Whether the parser's extract_tool_calls takes ``token_ids`` (llmhal's parsers; vLLM-style
    plugins read the text only)."""
    return "token_ids" in inspect.signature(parser_cls.extract_tool_calls).parameters


def can_stream(parser_cls: type[ToolParser]) -> bool:
    """Whether the parser has a streaming path (the base's only raises)."""
    return parser_cls.extract_tool_calls_streaming is not ToolParser.extract_tool_calls_streaming


def plan(
    body: dict[str, Any], tokenizer: Any, parser_cls: type[ToolParser] | None, auto_enabled: bool
) -> ToolPlan | None:
    """The request's tool handling, or None when it has no tools (then ``tool_choice`` may only
    be absent or "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools")
        return None
    functions = _functions(tools)
    choice = "auto" if choice is None else choice
    p = ToolPlan("none", tools, functions, tokenizer=tokenizer)
    if choice == "none":
        return p
    if choice == "auto":
        if not (auto_enabled and parser_cls is not None):
            raise BadRequest(AUTO_NEEDS)
        p.mode, p.parser_cls = "auto", parser_cls
        return p
    if choice == "required":
        p.mode = "required"
        p.structured = StructuredOutputsParams(json=_required_schema(functions), disable_any_whitespace=True)  # fmt: skip
        return p
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not (
        isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)
    ):
        raise BadRequest(f'tool_choice must be "none", "auto", "required" or {{type: function, function: {{name}}}}, got {choice!r}')  # fmt: skip
    if name not in functions:
        raise BadRequest(
            f"tool_choice names {name!r}, which is not in tools ({', '.join(functions)})"
        )
    p.mode, p.name = "named", name
    p.structured = StructuredOutputsParams(json=functions[name]["parameters"], disable_any_whitespace=True)  # fmt: skip
    return p


def _required_schema(functions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A JSON list of calls, each one tool's ``{"name", "parameters"}``. Each tool's ``$defs``
    (and ``definitions``) move to the top, where its ``#/$defs/...`` references point once its
    schema is nested; two tools defining one name differently are refused (vLLM's rule)."""
    hoisted: dict[str, dict[str, Any]] = {}
    one_of = []
    for n, f in functions.items():
        params = dict(f["parameters"])
        for key in ("$defs", "definitions"):
            defs = params.pop(key, None) or {}
            if not isinstance(defs, dict):
                raise BadRequest(f"tool {n!r}: parameters.{key} must be an object")
            for def_name, schema in defs.items():
                seen = hoisted.setdefault(key, {})
                if def_name in seen and seen[def_name] != schema:
                    raise BadRequest(f"tools define {key}/{def_name} differently; rename one")
                seen[def_name] = schema
        one_of.append({"type": "object", "properties": {"name": {"enum": [n]}, "parameters": params},
                       "required": ["name", "parameters"], "additionalProperties": False})  # fmt: skip
    return {"type": "array", "minItems": 1, "items": {"anyOf": one_of}, **hoisted}


class ToolStream:
    """One streamed choice's tool handling: what each update sends (content, call pieces)."""

    def __init__(self, plan: ToolPlan, body: dict[str, Any]) -> None:
        self.plan, self.body = plan, body
        self.parser = plan.parser() if plan.mode == "auto" else None
        self.text = ""
        self.ids: list[int] = []
        self.sent_content = ""
        self.sent_calls = 0

    def _rest(self, text: str, finish: str) -> tuple[str, list[DeltaToolCall]]:
        """At the end: the content and calls of the finished text's reading beyond what was sent
        (text held back as a possible tag, a call left unclosed at EOS)."""
        content, calls, _ = self.plan.final(text, finish, self.body, self.ids)
        content = content or ""
        more = content[len(self.sent_content) :] if content.startswith(self.sent_content) else ""
        extra = [DeltaToolCall(i, c.id, c.function.name, c.function.arguments) for i, c in enumerate(calls)][self.sent_calls :]  # fmt: skip
        self.sent_content += more
        self.sent_calls += len(extra)
        return more, extra

    def step(self, text: str, ids: list[int], finish: str | None) -> tuple[str, list[DeltaToolCall], str | None]:  # fmt: skip
        prev_text, prev_ids = self.text, self.ids
        self.text, self.ids = text, ids
        mode = self.plan.mode
        if mode in ("named", "required"):  # the calls are whole only at the end
            if finish is None:
                return "", [], None
            _, calls, reason = self.plan.final(text, finish, self.body)
            return "", self._deltas(calls), reason
        if mode == "auto":
            dm = self.parser.extract_tool_calls_streaming(  # type: ignore[union-attr]
                prev_text, text, text[len(prev_text) :], prev_ids, ids, ids[len(prev_ids) :], self.body
            )  # fmt: skip
            content = (dm.content or "") if dm else ""
            calls = list(dm.tool_calls) if dm else []
            self.sent_content += content
            self.sent_calls += len(calls)
            if finish is not None:  # what the finished text holds and the stream has not sent
                more, extra = self._rest(text, finish)
                content, calls = content + more, calls + extra
            reason = "tool_calls" if finish == "stop" and self.sent_calls else finish
            return content, calls, reason
        return text[len(prev_text) :], [], finish

    def _deltas(self, calls: list[ToolCall]) -> list[DeltaToolCall]:
        return [DeltaToolCall(i, c.id, c.function.name, c.function.arguments) for i, c in enumerate(calls)]  # fmt: skip
