"""Tool-call parsers given the output's token ids (as vLLM's streaming parsers are): a marker the
model produced as its special token opens a call; the same characters written in ordinary
tokens (the model talking about the format, or quoting it) stay text. The tokenizer is the tiny
test one with every family's markers added as special tokens (conftest's ``tok``)."""

from __future__ import annotations

import json

import pytest

from llmhal.entrypoints.chat_tools import ToolPlan, ToolStream
from llmhal.tool_parsers.manager import ToolParserManager

# The families whose calls open with a special token of their vocabulary.
FAMILIES = ["hermes", "mistral", "qwen3_coder", "deepseek_v3", "deepseek_v31", "kimi_k2", "glm45",
            "internlm", "jamba", "openai", "granite"]  # fmt: skip


def parser_for(name, tok):
    return ToolParserManager.get_tool_parser(name)(tok)


def readable(calls):
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def cases(tool_cases, name):
    found = [c for c in tool_cases.CASES if c.parser == name and c.calls]
    assert found, name
    return found


def spelled_out(tok, text):
    """``text``'s ids with every special token written in ordinary tokens (same text)."""
    ids = tok.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == text
    return ids


def token_stream(parser, tok, ids, req):
    """The parser driven as the engine streams: one token more each step, with the ids so far;
    (content sent, calls sent as (name, arguments))."""
    prev, prev_ids, content, calls = "", [], "", []
    for k in range(1, len(ids) + 1):
        cur = tok.decode(ids[:k], skip_special_tokens=False)
        dm = parser.extract_tool_calls_streaming(prev, cur, cur[len(prev) :], prev_ids, ids[:k], ids[len(prev_ids) : k], req)  # fmt: skip
        if dm is not None:
            content += dm.content or ""
            calls += [(d.name, json.loads(d.arguments)) for d in dm.tool_calls]
        prev, prev_ids = cur, ids[:k]
    return content, calls


@pytest.mark.parametrize("name", FAMILIES)
def test_markers_produced_as_tokens_open_calls(name, tool_cases, tok):
    req = tool_cases.REQUEST
    for case in cases(tool_cases, name):
        ids = tok.encode(case.text, add_special_tokens=False)
        info = parser_for(name, tok).extract_tool_calls(case.text, req, token_ids=ids)
        assert readable(info.tool_calls) == case.calls
        assert info.content == case.content


# qwen3_coder also reads a bare <function=...> block (text, not a special token) as a call.
@pytest.mark.parametrize("name", [f for f in FAMILIES if f != "qwen3_coder"])
def test_markers_written_in_ordinary_tokens_are_text(name, tool_cases, tok):
    req = tool_cases.REQUEST
    for case in cases(tool_cases, name):
        ids = spelled_out(tok, case.text)
        assert ids != tok.encode(case.text, add_special_tokens=False)
        info = parser_for(name, tok).extract_tool_calls(case.text, req, token_ids=ids)
        assert (info.tools_called, info.tool_calls) == (False, [])
        # openai's content is the harmony text's final channel; the others' the text itself
        if name != "openai":
            assert info.content == case.text
        content, calls = token_stream(parser_for(name, tok), tok, ids, req)
        assert calls == []
        # Without the ids the text alone is read: the spelled-out markers open calls.
        assert readable(parser_for(name, tok).extract_tool_calls(case.text, req).tool_calls) == case.calls  # fmt: skip


@pytest.mark.parametrize("name", ["hermes", "mistral", "qwen3_coder", "kimi_k2"])
def test_a_marker_quoted_in_the_content_before_a_real_call(name, tool_cases, tok):
    """'Calls look like <tool_call>...' in ordinary tokens, then a call: the quote is content,
    the call is read, in the finished text, token by token, and on the server's paths."""
    req = tool_cases.REQUEST
    case = cases(tool_cases, name)[0]
    marker = case.text[len(case.content or "") :][:14]  # the start of the real call section
    quote = f"Calls look like {marker} and so on. "
    text = quote + case.text
    ids = spelled_out(tok, quote) + tok.encode(case.text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    want_content = quote + (case.content or "")
    info = parser_for(name, tok).extract_tool_calls(text, req, token_ids=ids)
    assert readable(info.tool_calls) == case.calls
    assert info.content == want_content
    content, calls = token_stream(parser_for(name, tok), tok, ids, req)
    assert calls == case.calls
    assert content == want_content
    # The server: the finished answer and the stream (ToolStream), both given the ids.
    plan = ToolPlan("auto", req["tools"], {}, parser_cls=ToolParserManager.get_tool_parser(name), tokenizer=tok)  # fmt: skip
    final_content, final_calls, finish = plan.final(text, "stop", req, ids)
    assert (final_content, readable(final_calls), finish) == (
        want_content,
        case.calls,
        "tool_calls",
    )
    stream, sent, sent_calls = ToolStream(plan, req), "", []
    for k in range(1, len(ids) + 1):
        piece = tok.decode(ids[:k], skip_special_tokens=False)
        delta, deltas, _ = stream.step(piece, ids[:k], "stop" if k == len(ids) else None)
        sent += delta
        sent_calls += [d.name for d in deltas]
    assert sent == want_content and sent_calls == [n for n, _ in case.calls]


def test_ids_that_are_not_the_texts_leave_the_text_as_it_is(tool_cases, tok):
    """Ids of another text (e.g. all the output's, with the content after the reasoning as the
    text): no marker is taken for text; the reading is the text's own."""
    case = cases(tool_cases, "hermes")[0]
    other = tok.encode("<think>" + "x" * 9 + "</think>" + case.text, add_special_tokens=False)
    info = parser_for("hermes", tok).extract_tool_calls(case.text, tool_cases.REQUEST, token_ids=other)  # fmt: skip
    assert readable(info.tool_calls) == case.calls
    spelled = spelled_out(tok, "<tool_call>") + tok.encode(case.text, add_special_tokens=False)
    info = parser_for("hermes", tok).extract_tool_calls(case.text, tool_cases.REQUEST, token_ids=spelled)  # fmt: skip
    assert readable(info.tool_calls) == case.calls  # the ids' text is not this text


def test_a_text_holding_the_stand_in_characters_is_read_as_it_is(tool_cases, tok):
    case = cases(tool_cases, "hermes")[0]
    text = "\ufdd0 " + case.text
    ids = spelled_out(tok, text)
    info = parser_for("hermes", tok).extract_tool_calls(text, tool_cases.REQUEST, token_ids=ids)
    assert readable(info.tool_calls) == case.calls
