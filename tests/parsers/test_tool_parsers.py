"""The shared suite every tool-call parser passes (cases in tool_cases.py): the finished text's
calls and content, the same text streamed in many random chunkings (and token by token) adding
up to the finished answer, prefixes and corruptions never raising and staying consistent, and
the family's chat template rendering calls that the parser reads back."""

from __future__ import annotations

import json
import random

import pytest

from llmhal.entrypoints.chat_tools import ToolPlan, ToolStream
from llmhal.tool_parsers.manager import ToolParserManager


def parser_for(name: str, tok=None):
    return ToolParserManager.get_tool_parser(name)(tok)


def readable(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def chunkings(text: str, n: int, seed: int = 0):
    """``n`` random ways to cut ``text`` into pieces (1 to 8 characters), as cut points."""
    rng = random.Random(seed)
    if not text:
        yield [0]
        return
    for _ in range(n):
        cuts, k = [], 0
        while k < len(text):
            k = min(len(text), k + rng.randint(1, 8))
            cuts.append(k)
        yield cuts


def stream_parser(parser, text: str, cuts: list[int], request, ids_of=None):
    """Drive the parser's streaming method: (content sent, calls sent as (name, args, id))."""
    prev, content, calls, prev_ids = "", "", [], []
    for k in cuts:
        cur = text[:k]
        ids = ids_of(k) if ids_of else []
        dm = parser.extract_tool_calls_streaming(prev, cur, cur[len(prev) :], prev_ids, ids, ids[len(prev_ids) :], request)  # fmt: skip
        if dm is not None:
            content += dm.content or ""
            calls += [(d.name, json.loads(d.arguments), d.id) for d in dm.tool_calls]
            assert [d.index for d in dm.tool_calls] == list(range(len(calls) - len(dm.tool_calls), len(calls)))  # fmt: skip
        prev, prev_ids = cur, ids
    return content, calls


def server_stream(name: str, text: str, cuts: list[int], request):
    """The server's path (ToolStream, ending with "stop"): (content, calls, finish reason)."""
    plan = ToolPlan("auto", request["tools"], {}, parser_cls=ToolParserManager.get_tool_parser(name))  # fmt: skip
    stream, content, calls, finish = ToolStream(plan, request), "", [], None
    for k in cuts:
        delta, deltas, finish = stream.step(text[:k], [], "stop" if k == len(text) else None)
        content += delta
        calls += [(d.name, json.loads(d.arguments)) for d in deltas]
    final_content, final_calls, final_finish = plan.final(text, "stop", request)
    return (content, calls, finish), (final_content or "", readable(final_calls), final_finish)


def test_every_vllm_parser_name_is_registered():
    names = {"hermes", "llama3_json", "llama4_json", "llama4_pythonic", "pythonic", "mistral",
             "qwen3_coder", "deepseek_v3", "deepseek_v31", "granite", "internlm", "jamba",
             "kimi_k2", "glm45", "openai", "xlam", "phi4_mini_json"}  # fmt: skip
    assert names <= set(ToolParserManager.list_registered())


def test_the_finished_text(tool_case, tool_cases):
    info = parser_for(tool_case.parser).extract_tool_calls(tool_case.text, tool_cases.REQUEST)
    assert info.tools_called == bool(tool_case.calls)
    assert readable(info.tool_calls) == tool_case.calls
    assert info.content == tool_case.content
    assert len({c.id for c in info.tool_calls}) == len(info.tool_calls)
    if tool_case.ids:
        assert [c.id for c in info.tool_calls] == tool_case.ids
    if tool_case.parser == "mistral":  # Mistral's templates accept 9 letters and digits only
        assert all(len(c.id) == 9 and c.id.isalnum() for c in info.tool_calls)


def test_streams_add_up_to_the_finished_text(tool_case, tool_cases):
    req, text = tool_cases.REQUEST, tool_case.text
    for cuts in chunkings(text, 12, seed=len(text)):
        if tool_case.calls:  # the parser alone sends each call once, before the end
            content, calls = stream_parser(parser_for(tool_case.parser), text, cuts, req)
            assert [(n, a) for n, a, _ in calls] == tool_case.calls
            assert (content or None) == tool_case.content
            if tool_case.ids:
                assert [i for *_, i in calls] == tool_case.ids
        streamed, finished = server_stream(tool_case.parser, text, cuts, req)
        assert streamed == finished
        assert finished[1] == tool_case.calls


def test_a_token_by_token_stream(tool_case, tool_cases, tok):
    """Text as the engine streams it: each step one more token, decoded with special tokens
    kept (what adjust_request asks for), the token ids alongside."""
    parser = parser_for(tool_case.parser, tok)
    req = parser.adjust_request(dict(tool_cases.REQUEST))
    assert req["skip_special_tokens"] is False
    ids = tok.encode(tool_case.text, add_special_tokens=False)
    texts = [tok.decode(ids[:k], skip_special_tokens=False) for k in range(len(ids) + 1)]
    assert texts[-1] == tool_case.text
    whole = "".join(texts[-1:])
    cuts = [len(t) for t in texts[1:]]
    content, calls = stream_parser(parser, whole, cuts, req, ids_of=lambda k: ids[: cuts.index(k) + 1])  # fmt: skip
    finished = parser_for(tool_case.parser, tok).extract_tool_calls(whole, req)
    assert [(n, a) for n, a, _ in calls] == readable(finished.tool_calls) == tool_case.calls
    if tool_case.calls:
        assert (content or None) == finished.content


def _damaged(text: str, rng: random.Random) -> list[str]:
    out = [text[:k] for k in sorted({rng.randrange(len(text) + 1) for _ in range(25)})]
    for _ in range(25):
        i = rng.randrange(len(text))
        j = min(len(text), i + rng.randint(1, 6))
        out += [text[:i] + text[j:], text[:i] + rng.choice(['"', "{", "}", "]", "<", ",", "(", "x", "\n"]) + text[i:]]  # fmt: skip
    return out


def test_malformed_and_partial_calls_never_raise_and_stay_consistent(tool_case, tool_cases):
    rng = random.Random(zlib_crc(tool_case.text))
    req = tool_cases.REQUEST
    for bad in _damaged(tool_case.text, rng):
        info = parser_for(tool_case.parser).extract_tool_calls(bad, req)
        if not info.tools_called and tool_case.parser != "openai":
            assert info.content in (bad, bad or None)  # no call: the text is the answer, as written
        for cuts in chunkings(bad, 2, seed=len(bad)):
            streamed, finished = server_stream(tool_case.parser, bad, cuts, req)
            assert streamed == finished, bad


def zlib_crc(text: str) -> int:
    import zlib

    return zlib.crc32(text.encode())


def test_the_familys_template_renders_calls_the_parser_reads_back(tool_family, tool_cases, tok):
    calls = [("get_weather", {"city": "Saint-Étienne", "days": 3}), ("get_time", {"zone": "CET"})]
    if tool_family == "internlm":
        calls = calls[:1]  # InternLM2 writes one call per turn
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"functions.{n}:{i}", "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)]}]  # fmt: skip
    rendered = tok.apply_chat_template(messages, chat_template=tool_cases.TEMPLATES[tool_family], tokenize=False)  # fmt: skip
    info = parser_for(tool_family, tok).extract_tool_calls(rendered, tool_cases.REQUEST)
    assert readable(info.tool_calls) == calls, rendered
    # through the tokenizer: the markers are single special tokens and survive the round trip
    ids = tok.encode(rendered, add_special_tokens=False)
    again = parser_for(tool_family, tok).extract_tool_calls(tok.decode(ids, skip_special_tokens=False), tool_cases.REQUEST)  # fmt: skip
    assert readable(again.tool_calls) == calls


def test_a_request_without_tools_keeps_special_tokens_skipped(tool_family, tool_cases):
    body = {"messages": []}
    assert parser_for(tool_family).adjust_request(body) == body
    assert "skip_special_tokens" not in parser_for(tool_family).adjust_request({**tool_cases.REQUEST, "tool_choice": "none"})  # fmt: skip


@pytest.mark.parametrize("name", ["llama3_json", "pythonic", "granite", "xlam"])
def test_whole_answer_formats_hold_back_a_possible_call(name, tool_cases):
    """Formats whose call is the whole answer send nothing while the answer may still be one."""
    parser = parser_for(name)
    opening = {"llama3_json": "{", "pythonic": "[", "granite": "[", "xlam": "["}[name]
    assert parser.extract_tool_calls_streaming("", "  " + opening, "  " + opening, [], [], [], tool_cases.REQUEST) is None  # fmt: skip


@pytest.mark.parametrize("name", ["qwen3_coder", "glm45"])
def test_text_values_are_typed_by_the_schema_of_a_dict_or_a_request_object(name, tool_cases):
    from types import SimpleNamespace

    case = next(c for c in tool_cases.CASES if c.parser == name and c.calls[0] == tool_cases.PARIS)  # fmt: skip
    for request in (tool_cases.REQUEST, SimpleNamespace(tools=tool_cases.REQUEST["tools"])):
        assert readable(parser_for(name).extract_tool_calls(case.text, request).tool_calls) == case.calls  # fmt: skip
    # without the schema a value is read as JSON when it parses: "2" is 2, "Paris" stays text
    untyped = parser_for(name).extract_tool_calls(case.text, {}).tool_calls
    assert readable(untyped) == [("get_weather", {"city": "Paris", "days": 2})]
    string_days = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"properties": {"days": {"type": "string"}}}}}]}  # fmt: skip
    assert readable(parser_for(name).extract_tool_calls(case.text, string_days).tool_calls) == [("get_weather", {"city": "Paris", "days": "2"})]  # fmt: skip
