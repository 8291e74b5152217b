"""Tool calling: the hermes parser (finished and streamed text), the parser registry, and the
server's tools / tool_choice (named and required through structured outputs, auto through a
parser), on a tiny random model whose calls are forced with a structured-output regex."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from llmhal import LLM
from llmhal.reasoning.manager import ReasoningParserManager
from llmhal.testing.http_client import post_json
from llmhal.tool_parsers.base import ToolParser
from llmhal.tool_parsers.hermes import HermesToolParser
from llmhal.tool_parsers.manager import ToolParserManager

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

TEXT = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'  # fmt: skip


def test_hermes_reads_calls_and_content():
    info = HermesToolParser(None).extract_tool_calls(TEXT, {})
    assert info.tools_called and info.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "UTC"})]  # fmt: skip
    assert len({c.id for c in info.tool_calls}) == 2
    plain = HermesToolParser(None).extract_tool_calls("no calls here", {})
    assert (plain.tools_called, plain.content) == (False, "no calls here")
    broken = HermesToolParser(None).extract_tool_calls('<tool_call>{"name": oops}</tool_call>', {})
    assert not broken.tools_called and broken.content.startswith("<tool_call>")
    unclosed = HermesToolParser(None).extract_tool_calls('<tool_call>{"name": "f", "arguments": {}}', {})  # fmt: skip
    assert [c.function.name for c in unclosed.tool_calls] == ["f"] and unclosed.content is None


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_streaming_sends_what_the_finished_text_holds(step):
    parser, text, content, calls = HermesToolParser(None), "", "", []
    for i in range(0, len(TEXT), step):
        prev, text = text, TEXT[: i + step]
        dm = parser.extract_tool_calls_streaming(prev, text, text[len(prev) :], [], [], [], {})
        if dm is not None:
            content += dm.content or ""
            calls += dm.tool_calls
            assert "<" not in (dm.content or "")  # never a piece of a tag
    assert content == "Let me check."
    assert [c.index for c in calls] == [0, 1]
    whole = HermesToolParser(None).extract_tool_calls(TEXT, {}).tool_calls
    assert [(c.name, c.arguments) for c in calls] == [(w.function.name, w.function.arguments) for w in whole]  # fmt: skip


def test_the_registry_finds_registers_and_refuses(tmp_path):
    assert ToolParserManager.get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(KeyError, match="Tool parser 'nope' not found. Available parsers: .*hermes"):
        ToolParserManager.get_tool_parser("nope")
    with pytest.raises(KeyError, match="already registered"):
        ToolParserManager.register_module("hermes", force=False, module=HermesToolParser)
    with pytest.raises(TypeError):
        ToolParserManager.register_module("x", module=dict)
    with pytest.raises(TypeError):
        ToolParserManager.register_module("x", force="yes")
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from llmhal.tool_parsers.base import ToolParser\n"
        "from llmhal.tool_parsers.manager import ToolParserManager\n"
        "@ToolParserManager.register_module('mine')\n"
        "class Mine(ToolParser):\n    pass\n"
    )
    try:
        ToolParserManager.import_tool_parser(str(plugin))
        cls = ToolParserManager.get_tool_parser("mine")
        assert cls.__name__ == "Mine" and issubclass(cls, ToolParser)
    finally:
        ToolParserManager.lazy_parsers.pop("mine", None)
        ToolParserManager.tool_parsers.pop("mine", None)


@pytest.fixture(scope="module")
def tool_server(tiny_models):
    from llmhal.entrypoints.serve import build_server

    folder, _ = tiny_models("llama")
    llm = LLM(folder, dtype="float32", max_model_len=256)
    srv = build_server(llm, "127.0.0.1", 0, model_name="tiny", tool_call_parser="hermes", enable_auto_tool_choice=True)  # fmt: skip
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()
    srv.state.loop.shutdown()


def chat(base: str, extra: dict, stream: bool = False):
    body = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 120, "temperature": 1.0,
            "seed": 2, "tools": TOOLS, "stream": stream, **extra}  # fmt: skip
    return post_json(base + "/v1/chat/completions", body, stream)


def assembled(events: list) -> tuple[str, list, str]:
    """(content, [(name, arguments)], finish_reason) put together from a chat stream."""
    content, calls, finish = "", {}, None
    for e in events:
        c = e["choices"][0]
        content += c["delta"].get("content") or ""
        for t in c["delta"].get("tool_calls", []):
            slot = calls.setdefault(t["index"], ["", ""])
            slot[0] += t.get("function", {}).get("name", "")
            slot[1] += t.get("function", {}).get("arguments", "")
        finish = c["finish_reason"] or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_a_named_tool_choice_gives_a_valid_call(tool_server):
    named = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    status, resp = chat(tool_server, named)
    assert status == 200, resp
    msg = resp["choices"][0]["message"]
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "get_weather" and msg["content"] == ""
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["get_weather"])
    status, events = chat(tool_server, named, stream=True)
    content, calls, finish = assembled(events)
    assert (content, calls) == ("", [("get_weather", call["function"]["arguments"])])


def test_required_gives_one_or_more_valid_calls(tool_server):
    status, resp = chat(tool_server, {"tool_choice": "required", "max_tokens": 200})
    assert status == 200, resp
    choice = resp["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert calls and choice["finish_reason"] == "tool_calls"
    for c in calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])


def test_auto_reads_the_models_calls_with_the_parser(tool_server):
    # The random model is made to write a hermes call (structured outputs), the parser reads it.
    forced = {"structured_outputs": {"regex": r'Sure\.<tool_call>\{"name": "get_time", "arguments": \{"zone": "CET"\}\}</tool_call>'}}  # fmt: skip
    status, resp = chat(tool_server, {"tool_choice": "auto", **forced})
    assert status == 200, resp
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure."
    (call,) = choice["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_time", {"zone": "CET"})  # fmt: skip
    status, events = chat(tool_server, forced, stream=True)  # auto is the default with tools
    assert assembled(events) == ("Sure.", [("get_time", '{"zone": "CET"}')], "tool_calls")


def test_none_answers_in_text(tool_server):
    status, resp = chat(tool_server, {"tool_choice": "none", "max_tokens": 5})
    assert status == 200 and resp["choices"][0]["message"]["tool_calls"] == []


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tool_choice": "sometimes"}, "tool_choice must be"),
        ({"tools": [{"type": "function"}]}, "tools[0] must be"),
        ({"tools": []}, "non-empty list"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "already constrains",
        ),
    ],
)
def test_tool_errors_say_what_is_wrong(tool_server, extra, words):
    status, resp = chat(tool_server, extra)
    assert status == 400 and words in resp["error"]["message"], resp


def test_auto_needs_the_servers_parser(server):
    base, _ = server  # started without --enable-auto-tool-choice
    status, resp = chat(base, {})
    assert status == 400 and "--enable-auto-tool-choice" in resp["error"]["message"]
    # max_tokens null: the rest of the 128-token context (120 past it is a 400, vLLM's rule).
    status, resp = chat(base, {"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "max_tokens": None})  # fmt: skip
    assert status == 200 and resp["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"  # fmt: skip
    body = {"prompt": "a", "tools": TOOLS}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert (
        e.value.code == 400 and "only supported on /v1/chat/completions" in e.value.read().decode()
    )


def test_hermes_keeps_the_good_calls_and_the_content_as_written():
    text = (
        'Sure.\n\n<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{bad}</tool_call>'
    )
    info = HermesToolParser(None).extract_tool_calls(text, {})
    assert [c.function.name for c in info.tool_calls] == ["f"] and info.content == "Sure.\n\n"


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("a < b <", "a < b <", []),  # held back as a possible tag, then owed at the end
        ('Hi <tool_call>{"name": "f", "arguments": {}}', "Hi ", [("f", "{}")]),  # unclosed at EOS
        ("Use the <tool_call> tag please", "Use the <tool_call> tag please", []),
    ],
)
def test_a_stream_ends_with_what_the_finished_text_holds(text, content, calls):
    from llmhal.entrypoints.chat_tools import ToolPlan, ToolStream

    plan = ToolPlan("auto", TOOLS, {}, parser_cls=HermesToolParser)
    stream, got, got_calls, finish = ToolStream(plan, {}), "", [], None
    for k in range(1, len(text) + 1):
        delta, deltas, finish = stream.step(text[:k], [], "stop" if k == len(text) else None)
        got += delta
        got_calls += [(d.name, d.arguments) for d in deltas]
    assert (got, got_calls) == (content, calls)
    assert finish == ("tool_calls" if calls else "stop")


def test_required_handles_defs_and_streams(tool_server):
    loc = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"], "additionalProperties": False}  # fmt: skip
    tool = {"type": "function", "function": {"name": "visit", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Loc"}}, "required": ["to"],
        "additionalProperties": False, "$defs": {"Loc": loc}}}}  # fmt: skip
    body = {"tools": [tool, TIME], "tool_choice": "required", "max_tokens": 200}
    status, resp = chat(tool_server, body)
    assert status == 200, resp
    for c in resp["choices"][0]["message"]["tool_calls"]:
        schema = tool["function"]["parameters"] if c["function"]["name"] == "visit" else SCHEMAS["get_time"]  # fmt: skip
        jsonschema.validate(json.loads(c["function"]["arguments"]), schema)
    status, events = chat(tool_server, body, stream=True)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    content, calls, finish = assembled(events)
    assert calls and finish == "tool_calls" and content == ""
    other = {"type": "function", "function": {"name": "other", "parameters": {"$defs": {"Loc": {"type": "string"}}}}}  # fmt: skip
    status, resp = chat(tool_server, {"tools": [tool, other], "tool_choice": "required"})
    assert status == 400 and "define $defs/Loc differently" in resp["error"]["message"]


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"tool_choice": {"type": "function", "function": "get_time"}}, "tool_choice must be"),
        ({"tool_choice": {"type": "function", "function": None}}, "tool_choice must be"),
        ({"tools": [WEATHER, WEATHER]}, "repeats the function name"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"$defs": [1]}}}
                ],
                "tool_choice": "required",
            },
            "must be an object",
        ),
    ],
)
def test_malformed_tool_requests_are_a_400(tool_server, extra, words):
    status, resp = chat(tool_server, extra)
    assert status == 400 and words in resp["error"]["message"], resp


def test_null_parameters_mean_none(tool_server):
    bare = {"type": "function", "function": {"name": "ping", "parameters": None}}
    status, resp = chat(tool_server, {"tools": [bare], "tool_choice": {"type": "function", "function": {"name": "ping"}}})  # fmt: skip
    assert status == 200 and json.loads(resp["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {}  # fmt: skip


def test_a_parser_without_a_streaming_path_is_known():
    from llmhal.entrypoints.chat_tools import can_stream

    class FinishedOnly(ToolParser):
        def extract_tool_calls(self, model_output, request):
            raise NotImplementedError

    assert can_stream(HermesToolParser) and not can_stream(FinishedOnly)


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--tool-call-parser", "nope"],
            f"unknown --tool-call-parser 'nope' (known: {', '.join(ToolParserManager.list_registered())})",
        ),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (
            ["--reasoning-parser", "nope"],
            f"unknown --reasoning-parser 'nope' (known: {', '.join(ReasoningParserManager.list_registered())})",
        ),
    ],
)
def test_serve_checks_its_parser_flags_before_loading(argv, words, capsys):
    from llmhal.entrypoints.serve import main

    assert main(["--port", "0", *argv]) == 2
    assert words in capsys.readouterr().err
