"""Reasoning parsers: streamed pieces add up to the finished split, the id-based answers, the
registry, and the server's reasoning_content (a tiny model whose tokenizer has <think> tags,
made to write them with a structured-output regex)."""

from __future__ import annotations

import json
import threading

import pytest

from llmhal import LLM
from llmhal.reasoning.base import ReasoningParser
from llmhal.reasoning.manager import ReasoningParserManager
from llmhal.reasoning.parsers import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from llmhal.testing.http_client import post_json
from llmhal.testing.tiny_models import make_tiny_model, make_tokenizer


@pytest.fixture(scope="module")
def tok():
    t = make_tokenizer(382)
    t.add_tokens(["<think>", "</think>"])  # added, not special: they stay in the text (as R1's)
    return t


TEXTS = ["<think>hmm</think>Paris", "hmm</think>Paris", "Paris", "<think>still thinking",
         "intro <think>a</think> b", "a <thin", "x</thi", "<think>a</think>b</think>c", ""]  # fmt: skip
EXPECTED = {  # text -> (R1's split, Qwen3's split)
    "<think>hmm</think>Paris": (("hmm", "Paris"), ("hmm", "Paris")),
    "hmm</think>Paris": (("hmm", "Paris"), (None, "hmm</think>Paris")),
    "Paris": (("Paris", None), (None, "Paris")),
    "<think>still thinking": (("still thinking", None), ("still thinking", None)),
    "intro <think>a</think> b": (("intro a", " b"), ("a", "intro  b")),
}


@pytest.mark.parametrize("cls", [DeepSeekR1ReasoningParser, Qwen3ReasoningParser])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 5])
def test_streamed_pieces_add_up_to_the_finished_split(tok, cls, text, step):
    whole = cls(tok).extract_reasoning(text)
    if text in EXPECTED:
        assert whole == EXPECTED[text][cls is Qwen3ReasoningParser]
    p, prev, reasoning, content = cls(tok), "", "", ""
    cuts = [*range(step, len(text), step), len(text)]
    for k in cuts:
        cur = text[:k]
        for dm in (p.extract_reasoning_streaming(prev, cur, cur[len(prev) :], [], [], []),):
            if dm is not None:
                assert not (dm.reasoning and "<think>" in dm.reasoning)  # never a tag's text
                reasoning += dm.reasoning or ""
                content += dm.content or ""
        prev = cur
    dm = p.flush(text)
    if dm is not None:
        reasoning += dm.reasoning or ""
        content += dm.content or ""
    assert (reasoning or None, content or None) == whole


def test_the_id_based_answers(tok):
    p = DeepSeekR1ReasoningParser(tok)
    s, e = p.start_token_id, p.end_token_id
    assert (s, e) == tuple(tok.convert_tokens_to_ids(["<think>", "</think>"]))
    assert p.is_reasoning_end([s, 5, e, 7]) and not p.is_reasoning_end([e, 5, s, 7])
    assert not p.is_reasoning_end([5, 6])
    assert p.is_reasoning_end_streaming([s, 5, e], [e]) and not p.is_reasoning_end_streaming(
        [s, 5], [5]
    )
    assert p.extract_content_ids([s, 5, e, 7, 8]) == [7, 8]
    assert p.extract_content_ids([s, 5, e]) == []  # the end token last: no content yet
    assert p.count_reasoning_tokens([s, 5, 6, e, 7]) == 2
    assert p.count_reasoning_tokens([5, 6, e, 7]) == 2  # R1 starts inside
    assert Qwen3ReasoningParser(tok).count_reasoning_tokens([5, 6, 7]) == 0


def test_parsers_refuse_a_model_without_their_tags():
    with pytest.raises(RuntimeError, match="is this a reasoning model"):
        Qwen3ReasoningParser(make_tokenizer())
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        DeepSeekR1ReasoningParser(None)


def test_the_registry():
    assert ReasoningParserManager.get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert {"deepseek_r1", "qwen3"} <= set(ReasoningParserManager.list_registered())
    with pytest.raises(
        KeyError, match="Reasoning parser 'nope' not found. Available parsers: deepseek_r1"
    ):
        ReasoningParserManager.get_reasoning_parser("nope")
    assert issubclass(DeepSeekR1ReasoningParser, ReasoningParser)


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory, tok):
    from llmhal.entrypoints.serve import build_server

    folder = tmp_path_factory.mktemp("thinking")
    make_tiny_model(folder, "llama")
    tok.save_pretrained(folder)  # the same 384-entry vocabulary, two of them the tags
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    srv = build_server(llm, "127.0.0.1", 0, model_name="tiny", reasoning_parser="deepseek_r1")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()
    srv.state.loop.shutdown()


def test_the_server_sends_reasoning_apart_from_content(thinking_server):
    forced = {"regex": "Let me see[.]</think>It is Paris[.]"}
    body = {"messages": [{"role": "user", "content": "capital?"}], "max_tokens": 60, "temperature": 1.0,
            "structured_outputs": forced}  # fmt: skip
    status, resp = post_json(thinking_server + "/v1/chat/completions", body)
    assert status == 200, resp
    msg = resp["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["reasoning"], msg["content"]) == ("Let me see.", "Let me see.", "It is Paris.")  # fmt: skip
    status, events = post_json(thinking_server + "/v1/chat/completions", {**body, "stream": True}, stream=True)  # fmt: skip
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Let me see."
    assert "".join(d.get("content") or "" for d in deltas) == "It is Paris."
    assert not any(d.get("content") and d.get("reasoning_content") for d in deltas)


def test_serve_refuses_a_reasoning_parser_the_model_cannot_use(tiny_models):
    from llmhal.entrypoints.serve import build_server

    folder, _ = tiny_models("llama")
    with pytest.raises(RuntimeError, match="<think>"):
        build_server(LLM(folder, dtype="float32", max_model_len=64), "127.0.0.1", 0, reasoning_parser="qwen3")  # fmt: skip


def test_a_constrained_answer_is_all_content(thinking_server):
    """response_format (or a named tool) constrains the output from its first token, so there is
    no reasoning before it: the JSON is the content, not reasoning."""
    body = {"messages": [{"role": "user", "content": "json"}], "max_tokens": 60, "temperature": 1.0,
            "structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "boolean"}},
                                            "required": ["a"], "additionalProperties": False},
                                   "disable_any_whitespace": True}}  # fmt: skip
    status, resp = post_json(thinking_server + "/v1/chat/completions", body)
    assert status == 200, resp
    msg = resp["choices"][0]["message"]
    assert msg.get("reasoning_content") is None and isinstance(
        json.loads(msg["content"])["a"], bool
    )


def test_a_vllm_style_parser_without_flush_streams(tok):
    from llmhal.entrypoints.chat_output import ChatOutput

    class Plain(ReasoningParser):  # vLLM's contract only: no flush()
        def extract_reasoning_streaming(self, prev, cur, delta, prev_ids, cur_ids, delta_ids):
            from llmhal.reasoning.base import DeltaMessage

            assert list(cur_ids[len(prev_ids) :]) == list(delta_ids)  # ids line up with the text
            return DeltaMessage(content=delta)

    stream = ChatOutput(None, Plain, tok, {}).stream()
    got = [stream.step("ab", [1, 2], None), stream.step("abc", [1, 2, 3], "stop")]
    assert [g[0] for g in got] == ["ab", "c"] and got[-1][3] == "stop"


@pytest.fixture(scope="module")
def thinking_folder(tmp_path_factory, tok):
    folder = tmp_path_factory.mktemp("thinking_gate")
    make_tiny_model(folder, "llama")
    tok.save_pretrained(folder)
    return str(folder)


def test_the_grammar_waits_for_the_reasoning_to_end(thinking_folder, tok):
    """vLLM's gate: with a reasoning parser in structured_outputs_config, a constrained request
    reasons freely, and its grammar starts after the end tag. The model is pushed to close its
    reasoning at once (logit_bias): the gate lets that token through, the grammar alone would not."""
    from llmhal import SamplingParams
    from llmhal.structured_output import StructuredOutputsParams

    pytest.importorskip("xgrammar")
    end, start = tok.convert_tokens_to_ids(["</think>", "<think>"])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}  # fmt: skip
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = SamplingParams(temperature=0, max_tokens=40, logit_bias={end: 100.0}, structured_outputs=so)  # fmt: skip
    gated = LLM(thinking_folder, dtype="float32", max_model_len=128,
                structured_outputs_config={"reasoning_parser": "deepseek_r1"})  # fmt: skip
    out = gated.generate({"prompt_token_ids": [5, 6]}, params)[0].outputs[0]
    assert out.token_ids[0] == end and out.finish_reason == "stop"
    reasoning, content = DeepSeekR1ReasoningParser(tok).extract_reasoning(out.text)
    assert reasoning is None and isinstance(json.loads(content)["ok"], bool)
    # A prompt whose reasoning is already over: the grammar applies from the first token.
    out = gated.generate({"prompt_token_ids": [5, start, 6, end]}, params)[0].outputs[0]
    assert out.token_ids[0] != end and isinstance(json.loads(out.text)["ok"], bool)
    # Without the gate the grammar rules the end tag out from the start.
    plain = LLM(thinking_folder, dtype="float32", max_model_len=128)
    out = plain.generate({"prompt_token_ids": [5, 6]}, params)[0].outputs[0]
    assert end not in out.token_ids and isinstance(json.loads(out.text)["ok"], bool)


def test_the_gate_needs_a_known_parser_and_its_tags(thinking_folder, tiny_models):
    with pytest.raises(KeyError, match="Reasoning parser 'nope' not found"):
        LLM(thinking_folder, structured_outputs_config={"reasoning_parser": "nope"})
    folder, _ = tiny_models("llama")
    with pytest.raises(RuntimeError, match="<think>"):
        LLM(folder, dtype="float32", max_model_len=64, structured_outputs_config={"reasoning_parser": "qwen3"})  # fmt: skip


def test_serves_reasoning_parser_also_gates_the_grammar():
    import argparse

    from llmhal.entrypoints.engine_args import _structured_outputs_config

    args = argparse.Namespace(structured_outputs_backend="xgrammar", reasoning_parser="qwen3")
    assert _structured_outputs_config(args) == {"backend": "xgrammar", "reasoning_parser": "qwen3"}
    assert _structured_outputs_config(argparse.Namespace()) == {"backend": "auto"}


def test_a_prompt_that_ended_the_reasoning_gets_all_content(thinking_server):
    forced = {"regex": "Let me see[.]</think>It is Paris[.]"}
    body = {"messages": [{"role": "user", "content": "<think>no thinking</think> capital?"}],
            "max_tokens": 60, "temperature": 1.0, "structured_outputs": forced}  # fmt: skip
    status, resp = post_json(thinking_server + "/v1/chat/completions", body)
    assert status == 200, resp
    msg = resp["choices"][0]["message"]
    assert (
        msg.get("reasoning_content") is None and msg["content"] == "Let me see.</think>It is Paris."
    )


def test_the_server_uses_the_engines_reasoning_parser(thinking_folder):
    from llmhal.entrypoints.serve import build_server

    gated = LLM(thinking_folder, dtype="float32", max_model_len=64,
                structured_outputs_config={"reasoning_parser": "deepseek_r1"})  # fmt: skip
    srv = build_server(gated, "127.0.0.1", 0)
    try:
        assert srv.state.reasoning_cls is DeepSeekR1ReasoningParser
    finally:
        srv.server_close()
        srv.state.loop.shutdown()
    with pytest.raises(ValueError, match="differs from the engine's 'deepseek_r1'"):
        build_server(gated, "127.0.0.1", 0, reasoning_parser="qwen3")
