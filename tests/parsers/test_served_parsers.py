"""A new parser end to end through ``llmhal serve``'s HTTP server: a tiny random model is made
to write a Mistral v11 call (a structured-output regex), and the ``mistral`` parser reads it in
a full answer and in a stream (content first, then the call with a Mistral-shaped id)."""

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
def mistral_server(tmp_path_factory):
    from llmhal.entrypoints.serve import build_server

    folder = tmp_path_factory.mktemp("tiny_mistral_calls")
    make_tiny_model(folder, "llama")
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
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
