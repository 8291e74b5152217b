"""The server's finished answers give the tool parser the output's token ids, as its streams do:
a tiny llama whose tokenizer has hermes' ``<tool_call>`` and ``</tool_call>`` as special tokens
is made to write a call (a structured-output regex); produced as those tokens the call is read,
spelled out in ordinary tokens (the special ones not allowed) it stays content."""

from __future__ import annotations

import json
import threading

import pytest

from llmhal import LLM
from llmhal.testing.http_client import post_json
from llmhal.testing.tiny_models import make_tiny_model

pytest.importorskip("xgrammar")
MARKERS = ["<tool_call>", "</tool_call>"]
PARAMS = {"type": "object", "properties": {"zone": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": PARAMS}}]
CALL = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
FORCED = {"structured_outputs": {"regex": r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "CET"\}\}</tool_call>'}}  # fmt: skip


@pytest.fixture(scope="module")
def hermes_server(tmp_path_factory):
    from llmhal.entrypoints.serve import build_server
    from llmhal.testing.tiny_models import make_tokenizer

    folder = tmp_path_factory.mktemp("tiny_hermes_markers")
    make_tiny_model(folder, "llama")
    tok = make_tokenizer(382)
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tok.save_pretrained(folder)  # 384 entries, as the tiny model's vocabulary
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    srv = build_server(llm, "127.0.0.1", 0, model_name="tiny", tool_call_parser="hermes", enable_auto_tool_choice=True)  # fmt: skip
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", tok.convert_tokens_to_ids(MARKERS)
    srv.shutdown()
    srv.server_close()
    srv.state.loop.shutdown()


def ask(base: str, extra: dict) -> tuple[dict, str, list[str]]:
    body = {"messages": [{"role": "user", "content": "time?"}], "max_tokens": 120, "temperature": 0,
            "tools": TOOLS, "logprobs": True, **FORCED, **extra}  # fmt: skip
    status, resp = post_json(base + "/v1/chat/completions", body)
    assert status == 200, resp
    choice = resp["choices"][0]
    return choice["message"], choice["finish_reason"], [e["token"] for e in choice["logprobs"]["content"]]  # fmt: skip


def test_a_finished_chat_answer_tells_produced_markers_from_spelled_ones(hermes_server):
    base, special = hermes_server
    msg, finish, tokens = ask(base, {"logit_bias": {str(i): 100 for i in special}})
    assert tokens[0] == "<tool_call>" and "</tool_call>" in tokens
    (call,) = msg["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_time", {"zone": "CET"})  # fmt: skip
    assert (msg["content"], finish) == (None, "tool_calls")
    # The same text in ordinary tokens: read without the ids it would be a call.
    msg, finish, tokens = ask(base, {"allowed_token_ids": [i for i in range(384) if i not in special]})  # fmt: skip
    assert tokens[0] == "<" and "<tool_call>" not in tokens
    assert (msg["content"], msg["tool_calls"], finish) == (CALL, [], "stop")


def test_a_responses_answer_keeps_spelled_markers_as_text(hermes_server):
    """Responses takes no logit_bias nor allowed_token_ids; greedily this model spells the
    markers out in ordinary tokens (chat's log-probabilities show it), and the answer is text,
    as chat's is."""
    base, _ = hermes_server
    msg, _, tokens = ask(base, {})
    assert tokens[0] == "<" and "<tool_call>" not in tokens
    assert (msg["content"], msg["tool_calls"]) == (CALL, [])
    tool = {"type": "function", "name": "get_time", "parameters": PARAMS}
    body = {"input": "time?", "max_output_tokens": 120, "temperature": 0, "tools": [tool], **FORCED}  # fmt: skip
    status, resp = post_json(base + "/v1/responses", body)
    assert status == 200, resp
    assert [o["type"] for o in resp["output"]] == ["message"]
    assert "".join(p["text"] for p in resp["output"][0]["content"]) == CALL
