"""New parsers end to end on a tiny random model: through ``llmhal serve``'s HTTP server, the
model made to write a Mistral v11 call (a structured-output regex) and the ``mistral`` parser
reading it in a full answer and a stream; and in the engine, the structured-output gate of a
reasoning parser whose end marker is several tokens (``hunyuan_a13b``)."""

from __future__ import annotations

import json
import threading

import pytest

from llmhal import LLM
from llmhal.testing.http_client import post_json
from llmhal.testing.tiny_models import make_tiny_model

pytest.importorskip("xgrammar")
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}]  # fmt: skip
FORCED = {"structured_outputs": {"regex": r'Sure\.\[TOOL_CALLS\]get_time\[ARGS\]\{"zone": "CET"\}'}}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The tiny llama, its tokenizer with Magistral's [THINK] and [/THINK] as special tokens."""
    from llmhal.testing.tiny_models import make_tokenizer

    folder = tmp_path_factory.mktemp("tiny_for_parsers")
    make_tiny_model(folder, "llama")
    tok = make_tokenizer(382)
    tok.add_special_tokens({"additional_special_tokens": ["[THINK]", "[/THINK]"]})
    tok.save_pretrained(folder)  # 384 entries, as the tiny model's vocabulary
    return str(folder)


@pytest.fixture(scope="module")
def mistral_server(tiny_folder):
    from llmhal.entrypoints.serve import build_server

    llm = LLM(tiny_folder, dtype="float32", max_model_len=256)
    srv = build_server(llm, "127.0.0.1", 0, model_name="tiny", tool_call_parser="mistral", enable_auto_tool_choice=True)  # fmt: skip
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()
    srv.state.loop.shutdown()


def test_the_mistral_parser_through_the_server(mistral_server):
    body = {"messages": [{"role": "user", "content": "time?"}], "max_tokens": 60, "tools": TOOLS, **FORCED}  # fmt: skip
    status, resp = post_json(mistral_server + "/v1/chat/completions", body)
    assert status == 200, resp
    choice = resp["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("Sure.", "tool_calls")
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_time", {"zone": "CET"})  # fmt: skip
    assert len(call["id"]) == 9 and call["id"].isalnum()
    status, events = post_json(mistral_server + "/v1/chat/completions", {**body, "stream": True}, True)  # fmt: skip
    content, calls, finish = "", [], None
    for e in events:
        delta = e["choices"][0]["delta"]
        content += delta.get("content") or ""
        calls += [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in delta.get("tool_calls", [])]  # fmt: skip
        finish = e["choices"][0]["finish_reason"] or finish
    assert (content, calls, finish) == ("Sure.", [("get_time", {"zone": "CET"})], "tool_calls")


def test_the_gate_of_a_parser_whose_end_marker_is_several_tokens(tiny_folder):
    """The prompt leaves ``</think`` open and the model is pushed to write ``>``: the gate
    (``hunyuan_a13b``, which reads the decoded ids) sees the end marker completed by that token
    and the JSON grammar starts after it; without the gate the grammar rules ``>`` out."""
    from llmhal import SamplingParams
    from llmhal.structured_output import StructuredOutputsParams

    gated = LLM(tiny_folder, dtype="float32", max_model_len=128, structured_outputs_config={"reasoning_parser": "hunyuan_a13b"})  # fmt: skip
    tok = gated.get_tokenizer()
    prompt = tok.encode("<think>\nhmm\n</think", add_special_tokens=False)
    close = tok.encode(">", add_special_tokens=False)
    assert len(close) == 1 and len(tok.encode("</think>", add_special_tokens=False)) > 1
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}  # fmt: skip
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = SamplingParams(temperature=0, max_tokens=30, logit_bias={close[0]: 100.0}, structured_outputs=so)  # fmt: skip
    out = gated.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    assert out.token_ids[0] == close[0] and json.loads(out.text[1:]) in ({"ok": True}, {"ok": False})  # fmt: skip
    plain = LLM(tiny_folder, dtype="float32", max_model_len=128)
    out = plain.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    assert out.token_ids[0] != close[0] and isinstance(json.loads(out.text)["ok"], bool)


def test_a_reasoning_parser_whose_tags_are_special_tokens_sees_them(tiny_folder):
    """``mistral``'s [THINK] is a special token: the server keeps special tokens in the text of
    a request (the parser's adjust_request), else the tags would vanish before the split. The
    model is pushed to write [THINK] three times; the answer's reasoning holds the last two."""
    from llmhal.entrypoints.serve import build_server

    llm = LLM(tiny_folder, dtype="float32", max_model_len=128)
    think = llm.get_tokenizer().convert_tokens_to_ids("[THINK]")
    srv = build_server(llm, "127.0.0.1", 0, model_name="tiny", reasoning_parser="mistral")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "logit_bias": {str(think): 100}}  # fmt: skip
        status, resp = post_json(f"http://127.0.0.1:{srv.server_address[1]}/v1/chat/completions", body)  # fmt: skip
        assert status == 200, resp
        assert resp["choices"][0]["message"]["reasoning_content"] == "[THINK][THINK]"
    finally:
        srv.shutdown()
        srv.server_close()
        srv.state.loop.shutdown()
