"""The shared suite every reasoning parser passes (cases in reasoning_cases.py): the finished
split, the same text streamed in many random chunkings and token by token adding up to it,
prefixes and corruptions never raising, and the id-based answers (is the reasoning over, the
content's ids) agreeing with the text."""

from __future__ import annotations

import random
import zlib

import pytest

from llmhal.reasoning.manager import ReasoningParserManager

NEW = ["deepseek_v3", "granite", "glm45", "mistral", "gpt_oss", "hunyuan_a13b", "ernie45"]


def parser_for(name: str, tok, **kwargs):
    return ReasoningParserManager.get_reasoning_parser(name)(tok, **kwargs)


def stream(parser, text: str, cuts: list[int], ids_of=None) -> tuple[str | None, str | None]:
    prev, prev_ids, reasoning, content = "", [], "", ""
    for k in cuts:
        cur = text[:k]
        ids = ids_of(k) if ids_of else []
        dm = parser.extract_reasoning_streaming(prev, cur, cur[len(prev) :], prev_ids, ids, ids[len(prev_ids) :])  # fmt: skip
        for piece in (dm, parser.flush(text) if k == len(text) else None):
            if piece is not None:
                reasoning += piece.reasoning or ""
                content += piece.content or ""
        prev, prev_ids = cur, ids
    return reasoning or None, content or None


def chunkings(text: str, n: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n):
        cuts, k = [], 0
        while k < len(text):
            k = min(len(text), k + rng.randint(1, 8))
            cuts.append(k)
        yield cuts or [0]


def test_every_named_parser_is_registered():
    assert {*NEW, "deepseek_r1", "qwen3", "openai_gptoss"} <= set(ReasoningParserManager.list_registered())  # fmt: skip


def test_the_finished_split(reasoning_case, tok):
    got = parser_for(reasoning_case.parser, tok).extract_reasoning(reasoning_case.text, {})
    assert got == (reasoning_case.reasoning, reasoning_case.content)


def test_streams_add_up_to_the_finished_split(reasoning_case, tok):
    text = reasoning_case.text
    for cuts in chunkings(text, 12, seed=len(text)):
        assert stream(parser_for(reasoning_case.parser, tok), text, cuts) == (reasoning_case.reasoning, reasoning_case.content)  # fmt: skip


def test_a_token_by_token_stream_and_the_id_based_answers(reasoning_case, tok):
    parser = parser_for(reasoning_case.parser, tok)
    ids = tok.encode(reasoning_case.text, add_special_tokens=False)
    texts = [tok.decode(ids[:k], skip_special_tokens=False) for k in range(1, len(ids) + 1)]
    assert texts[-1] == reasoning_case.text
    cuts = [len(t) for t in texts]
    got = stream(parser, reasoning_case.text, cuts, ids_of=lambda k: ids[: cuts.index(k) + 1])
    assert got == (reasoning_case.reasoning, reasoning_case.content)
    fresh = parser_for(reasoning_case.parser, tok)
    assert fresh.is_reasoning_end(ids) == reasoning_case.ended
    # the gate's per-token answer turns true at the token that ends the reasoning (it looks at
    # the end marker alone, as vLLM's: an end marker in text that never started reasoning counts)
    # (asked as the engine asks: the prompt and output ids as one TokenView, the new token alone)
    from llmhal.engine.request import TokenView

    ends = [k for k in range(1, len(ids) + 1) if fresh.is_reasoning_end_streaming(TokenView([], ids[: k - 1], ids[k - 1 : k]), ids[k - 1 : k])]  # fmt: skip
    if reasoning_case.ended:
        assert not fresh.is_reasoning_end(ids[: ends[0] - 1]) and fresh.is_reasoning_end(ids[: ends[0]])  # fmt: skip
        content_ids = fresh.extract_content_ids(ids)
        assert content_ids == ids[ends[0] :]


def test_damaged_text_never_raises_and_still_adds_up(reasoning_case, tok):
    rng = random.Random(zlib.crc32(reasoning_case.text.encode()))
    text = reasoning_case.text
    damaged = [text[:k] for k in sorted({rng.randrange(len(text) + 1) for _ in range(20)})]
    for _ in range(20):
        i = rng.randrange(len(text))
        damaged += [text[:i] + text[i + rng.randint(1, 5) :], text[:i] + rng.choice("<>|/\n") + text[i:]]  # fmt: skip
    for bad in damaged:
        whole = parser_for(reasoning_case.parser, tok).extract_reasoning(bad, {})
        for cuts in chunkings(bad, 2, seed=len(bad)):
            assert stream(parser_for(reasoning_case.parser, tok), bad, cuts) == whole, bad


def test_deepseek_v3_follows_the_requests_thinking_switch(tok):
    text = "The capital.</think>Paris."
    assert parser_for("deepseek_v3", tok).extract_reasoning(text, {"chat_template_kwargs": {"thinking": False}}) == (None, text)  # fmt: skip
    off = parser_for("deepseek_v3", tok, chat_template_kwargs={"thinking": False})
    assert stream(off, text, [5, len(text)]) == (None, text)
    on = parser_for("deepseek_v3", tok, chat_template_kwargs={"enable_thinking": True})
    assert stream(on, text, [5, len(text)]) == ("The capital.", "Paris.")


def test_a_prompt_that_names_the_markers_has_not_ended_the_reasoning(tok):
    """Granite's thinking system prompt names both phrases: only the assistant turn counts."""
    system = "<|start_of_role|>system<|end_of_role|>Write your thoughts after 'Here is my thought process:' and your response after 'Here is my response:'."  # fmt: skip
    prompt = tok.encode(system + "<|start_of_role|>assistant<|end_of_role|>", add_special_tokens=False)  # fmt: skip
    assert not parser_for("granite", tok).is_reasoning_end(prompt)
    done = tok.encode(
        "Here is my thought process: a Here is my response:", add_special_tokens=False
    )
    assert parser_for("granite", tok).is_reasoning_end(prompt + done)
    gpt = tok.encode(
        "<|start|>user<|message|>hi<|end|><|start|>assistant", add_special_tokens=False
    )
    assert not parser_for("gpt_oss", tok).is_reasoning_end(gpt)
    glm = tok.encode(
        "<|assistant|><think></think>old answer<|assistant|>", add_special_tokens=False
    )
    assert not parser_for("glm45", tok).is_reasoning_end(glm)
    assert parser_for("glm45", tok).is_reasoning_end(glm + tok.encode("<think></think>"))


@pytest.mark.parametrize("name", ["mistral", "gpt_oss"])
def test_parsers_whose_markers_are_special_tokens_keep_them_in_the_text(name, tok):
    assert parser_for(name, tok).adjust_request({"messages": []})["skip_special_tokens"] is False


@pytest.mark.parametrize("name", NEW)
def test_a_parser_needs_the_tokenizer(name):
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        parser_for(name, None)


def test_the_server_hands_the_requests_template_kwargs_to_the_parser(tok):
    """A stream and a finished answer of the server's chat output both follow the request's
    thinking switch (vLLM passes chat_template_kwargs to the parser's constructor)."""
    from llmhal.entrypoints.chat_output import ChatOutput

    cls = ReasoningParserManager.get_reasoning_parser("deepseek_v3")
    text = "The capital.</think>Paris."
    for thinking, split in ((False, ("", text)), (True, ("The capital.", "Paris."))):
        out = ChatOutput(None, cls, tok, {"chat_template_kwargs": {"thinking": thinking}})
        msg, _ = out.message(text, "stop")
        assert (msg["reasoning_content"] or "", msg["content"]) == split
        choice, reasoning, content = out.stream(), "", ""
        for k in range(1, len(text) + 1):
            c, r, _, _ = choice.step(text[:k], [], "stop" if k == len(text) else None)
            content, reasoning = content + c, reasoning + r
        assert (reasoning, content) == split


@pytest.mark.parametrize("with_call", [True, False])
def test_gpt_oss_and_the_openai_tool_parser_together(with_call, tok):
    """gpt-oss served as vLLM does it (--reasoning-parser gpt_oss --tool-call-parser openai):
    the analysis channel is reasoning, a function message a call, the final channel content;
    the stream and the finished answer agree."""
    import json

    from llmhal.entrypoints.chat_output import ChatOutput
    from llmhal.entrypoints.chat_tools import ToolPlan
    from llmhal.tool_parsers.openai import OpenAIToolParser

    analysis = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
    tail = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"city": "Paris"}<|call|>') if with_call else "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"  # fmt: skip
    text = analysis + tail
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    plan = ToolPlan("auto", tools, {}, parser_cls=OpenAIToolParser)
    out = ChatOutput(
        plan, ReasoningParserManager.get_reasoning_parser("gpt_oss"), tok, {"tools": tools}
    )
    msg, finish = out.message(text, "stop")
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]
    ]
    assert msg["reasoning_content"] == "The user wants the weather."
    assert (calls, msg["content"] or "", finish) == (([("get_weather", {"city": "Paris"})], "", "tool_calls") if with_call else ([], "Sunny.", "stop"))  # fmt: skip
    for cuts in chunkings(text, 6, seed=7):
        choice, reasoning, content, streamed, reason = out.stream(), "", "", [], None
        for k in cuts:
            c, r, deltas, reason = choice.step(text[:k], [], "stop" if k == len(text) else None)
            content, reasoning = content + c, reasoning + r
            streamed += [(d.name, json.loads(d.arguments)) for d in deltas]
        assert (reasoning, content, streamed, reason) == (msg["reasoning_content"], msg["content"] or "", calls, finish)  # fmt: skip


def test_an_earlier_turns_closed_reasoning_does_not_end_the_new_one(tok):
    history = tok.encode("<think>\nold\n</think>\n<answer>\nA\n</answer>user: again<think>\nnew", add_special_tokens=False)  # fmt: skip
    assert not parser_for("hunyuan_a13b", tok).is_reasoning_end(history)
    assert parser_for("hunyuan_a13b", tok).is_reasoning_end(history + tok.encode("\n</think>\n"))
