"""`llmhal serve`'s vLLM request extras, side routes, API key, CORS, root path and limits, each
checked against the offline API or the tokenizer on a tiny model (one model, two front ends)."""

from __future__ import annotations

import copy
import json
import logging
import time
import urllib.request

import pytest

from llmhal import LLM, SamplingParams
from llmhal.testing.http_client import post_json, running_server

KEY = "sekret-key"


@pytest.fixture(scope="module")
def servers(tiny_models):
    """(plain base URL, guarded base URL, llm): the guarded front end has an API key, a root path,
    one allowed origin, /tokenizer_info, trusted request templates and a 64 KiB body limit."""
    folder, _ = tiny_models("llama")
    llm = LLM(folder, dtype="float32", max_model_len=128)
    with running_server(llm, model_name="tiny") as (plain, srv):
        # A second front end on the same engine loop, with the other settings.
        from llmhal.entrypoints.api_server import build_app
        from llmhal.entrypoints.serve import ApiServer

        state = copy.copy(srv.state)
        state.api_key, state.tokenizer_info, state.trust_request_chat_template = KEY, True, True
        state.max_request_bytes = 64 << 10
        app = build_app(state, allowed_origins=["https://a.example"])
        guarded = ApiServer(app, state, "127.0.0.1", 0, 64, root_path="/llm")
        import threading

        threading.Thread(target=guarded.serve_forever, daemon=True).start()
        yield plain, f"http://127.0.0.1:{guarded.server_address[1]}", llm
        guarded.shutdown()
        guarded.server_close()


def get(url: str, headers: dict | None = None) -> tuple[int, bytes, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


BASE = {"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0, "ignore_eos": True}


def test_unknown_and_accepted_but_ignored_fields_change_nothing(servers, caplog):
    plain, _, _ = servers
    status, want = post_json(plain + "/v1/completions", BASE)
    assert status == 200, want
    extras = {"best_of": 1, "user": "u", "length_penalty": 2.0, "spaces_between_special_tokens": False, "frobnicate": 1, "frobnicate2": {"a": 1}}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="llmhal"):
        for _ in range(2):
            status, got = post_json(plain + "/v1/completions", {**BASE, **extras})
            assert status == 200 and got["choices"][0]["text"] == want["choices"][0]["text"], got
    logged = [r.getMessage() for r in caplog.records if "Ignoring request field" in r.getMessage()]
    assert len(logged) == 1 and "frobnicate, frobnicate2" in logged[0]  # once per name
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    status, want = post_json(plain + "/v1/chat/completions", chat)
    ignored = {"parallel_tool_calls": False, "store": True, "metadata": {"k": "v"}, "service_tier": "auto",
               "reasoning_effort": "low", "functions": [], "function_call": "none"}  # fmt: skip
    status, got = post_json(plain + "/v1/chat/completions", {**chat, **ignored})
    assert status == 200 and got["choices"][0]["message"] == want["choices"][0]["message"], got


def test_stop_string_kept_with_include_stop_str_in_output(servers):
    plain, _, llm = servers
    text = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text  # fmt: skip
    stop = text[2:4]
    body = {**BASE, "max_tokens": 8, "stop": [stop]}
    for keep in (False, True):
        offline = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop], include_stop_str_in_output=keep))[0].outputs[0]  # fmt: skip
        status, resp = post_json(plain + "/v1/completions", {**body, "include_stop_str_in_output": keep})  # fmt: skip
        choice = resp["choices"][0]
        assert status == 200 and choice["text"] == offline.text and choice["stop_reason"] == stop
    assert choice["text"].endswith(stop)


def test_prompt_logprobs_token_ids_and_truncation(servers):
    plain, _, llm = servers
    prompt = [5, 17, 3, 99, 42, 8]
    offline = llm.generate({"prompt_token_ids": prompt[-4:]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2))[0]  # fmt: skip
    body = {"prompt": prompt, "truncate_prompt_tokens": 4, "prompt_logprobs": 2, "return_token_ids": True,
            "max_tokens": 3, "temperature": 0, "ignore_eos": True}  # fmt: skip
    status, resp = post_json(plain + "/v1/completions", body)
    assert status == 200, resp
    choice = resp["choices"][0]
    assert choice["prompt_token_ids"] == prompt[-4:] and choice["token_ids"] == offline.outputs[0].token_ids  # fmt: skip
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 4
    for entry, want, t in zip(plp[1:], offline.prompt_logprobs[1:], prompt[-3:], strict=True):
        assert entry[str(t)]["logprob"] == want[t].logprob and entry[str(t)]["rank"] == want[t].rank
    assert resp["usage"]["prompt_tokens"] == 4
    # Chat: prompt ids and prompt_logprobs at the top, generated ids per choice, and in streams.
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "prompt_logprobs": 0}  # fmt: skip
    status, full = post_json(plain + "/v1/chat/completions", chat)
    ids = llm.chat_prompt([{"role": "user", "content": "hi"}])["prompt_token_ids"]
    assert full["prompt_token_ids"] == ids and len(full["prompt_logprobs"]) == len(ids)
    status, events = post_json(plain + "/v1/chat/completions", {**chat, "stream": True}, stream=True)  # fmt: skip
    assert events[0]["prompt_token_ids"] == ids
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == full["choices"][0]["token_ids"]  # fmt: skip


def test_continuous_usage_stats(servers):
    plain, _, _ = servers
    body = {**BASE, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    status, events = post_json(plain + "/v1/completions", body, stream=True)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all(e["usage"]["prompt_tokens"] == 3 for e in events)
    assert counts == sorted(counts) and counts[-1] == 5 and events[-1]["choices"] == []


def test_chat_template_options_and_echo(servers):
    plain, guarded, llm = servers
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]
    body = {"messages": msgs, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "add_generation_prompt": False,
            "continue_final_message": True, "echo": True}  # fmt: skip
    status, resp = post_json(plain + "/v1/chat/completions", body)
    assert status == 200, resp
    text = llm.apply_chat_template(msgs, False, continue_final_message=True)
    assert resp["prompt_token_ids"] == tok.encode(text, add_special_tokens=False)
    offline = llm.generate({"prompt_token_ids": resp["prompt_token_ids"]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]  # fmt: skip
    assert resp["choices"][0]["message"]["content"] == "The" + offline.outputs[0].text  # echoed
    status, events = post_json(plain + "/v1/chat/completions", {**body, "stream": True}, stream=True)  # fmt: skip
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "The" + offline.outputs[0].text  # fmt: skip
    # A request's own template and its chat_template_kwargs, with --trust-request-chat-template.
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    own = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "return_token_ids": True,
           "chat_template": template, "chat_template_kwargs": {"greeting": "Hello "}}  # fmt: skip
    status, resp = post_json(plain + "/v1/chat/completions", own)
    assert status == 400 and "--trust-request-chat-template" in resp["error"]["message"]
    status, resp = post_json(guarded + "/v1/chat/completions", own, headers=AUTH)
    assert status == 200 and resp["prompt_token_ids"] == tok.encode("Hello hi", add_special_tokens=False)  # fmt: skip


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"suffix": "x"}, "suffix is not currently supported"),
        ({"use_beam_search": True}, "use_beam_search is not supported"),
        ({"priority": 3}, "priority scheduling is not enabled"),
        ({"truncate_prompt_tokens": -5}, "truncate_prompt_tokens"),
        ({"stream_options": {"include_usage": True}, "stream": False}, "only allowed with stream"),
        ({"guided_json": {}}, "structured_outputs"),
    ],
)
def test_unsupported_values_are_400s(servers, body, words):
    status, resp = post_json(servers[0] + "/v1/completions", {**BASE, **body})
    assert status == 400 and words in resp["error"]["message"], resp
    assert set(resp["error"]) == {"message", "type", "param", "code"} and resp["error"]["code"] == 400  # fmt: skip


def test_request_ids(servers):
    plain, _, _ = servers
    status, resp = post_json(plain + "/v1/completions", {**BASE, "request_id": "abc"})
    assert resp["id"] == "cmpl-abc"
    status, resp = post_json(plain + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}, headers={"X-Request-Id": "r1"})  # fmt: skip
    assert resp["id"] == "chatcmpl-r1"


def test_side_routes(servers, tiny_models):
    plain, _, llm = servers
    status, body, _ = get(plain + "/v1/models")
    card = json.loads(body)["data"][0]
    assert card["max_model_len"] == 128 and card["root"] == tiny_models("llama")[0]
    doc = json.loads(get(plain + "/openapi.json")[1])
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= set(doc["paths"])  # fmt: skip
    assert "truncate_prompt_tokens" in doc["components"]["schemas"]["CompletionRequest"]["properties"]  # fmt: skip
    assert b"swagger" in get(plain + "/docs")[1].lower()
    assert json.loads(get(plain + "/ping")[1]) == {"status": "ok"}
    assert post_json(plain + "/ping", {})[0] == 200
    assert json.loads(get(plain + "/load")[1]) == {"server_load": 0}
    status, body, _ = get(plain + "/tokenizer_info")  # off without the flag, as in vLLM
    assert status == 404 and "no route /tokenizer_info" in json.loads(body)["error"]["message"]


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_api_key_root_path_cors_and_tokenizer_info(servers):
    _, guarded, llm = servers
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, resp = post_json(guarded + "/v1/chat/completions", chat)
    assert status == 401 and resp["error"]["code"] == 401
    status, resp = post_json(guarded + "/v1/chat/completions", chat, headers={"Authorization": "Bearer wrong"})  # fmt: skip
    assert status == 401
    assert post_json(guarded + "/v1/chat/completions", chat, headers=AUTH)[0] == 200
    assert get(guarded + "/v1/models", AUTH)[0] == 200  # the proxy strips /llm
    assert get(guarded + "/v1/models")[0] == 401
    for open_route in ("/health", "/metrics", "/ping", "/version", "/tokenizer_info"):
        assert get(guarded + open_route)[0] == 200, open_route
    info = json.loads(get(guarded + "/tokenizer_info")[1])
    assert info["tokenizer_class"] == type(llm.get_tokenizer()).__name__
    assert info["chat_template"] == llm.get_tokenizer().chat_template
    doc = json.loads(get(guarded + "/openapi.json")[1])
    assert doc["servers"] == [{"url": "/llm"}]
    headers = {"Origin": "https://a.example", "Access-Control-Request-Method": "POST"}
    req = urllib.request.Request(guarded + "/v1/chat/completions", method="OPTIONS", headers=headers)  # fmt: skip
    with urllib.request.urlopen(req) as r:  # a preflight needs no key
        assert r.headers["access-control-allow-origin"] == "https://a.example"
    status, _, h = get(guarded + "/health", {"Origin": "https://b.example"})
    assert "access-control-allow-origin" not in {k.lower() for k in h}


def _read_until_closed(sock) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_limits(servers):
    plain, guarded, _ = servers
    # The body limit: declared or not, a 413 before it is all read.
    import socket

    port = int(guarded.rsplit(":", 1)[1])
    head = f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall((head + "Content-Length: 100000\r\n\r\n").encode())  # the body never comes
        answer = _read_until_closed(sock)  # uvicorn may send the head and the body in two writes
        assert answer.startswith(b"HTTP/1.1 413") and b"65536" in answer

    # Chunked, without a length: the client stops once past the limit and hears a 413 (a client
    # that kept sending after the server stopped reading would see the connection reset).
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall((head + "Transfer-Encoding: chunked\r\n\r\n").encode())
        for _ in range(9):  # 72 KiB
            sock.sendall(b"2000\r\n" + b"y" * 0x2000 + b"\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 413")
    # A prompt far past the context is refused by its length in characters, without tokenizing.
    t = time.monotonic()
    status, resp = post_json(plain + "/v1/completions", {"prompt": "word " * 400_000, "max_tokens": 1})  # fmt: skip
    assert status == 400 and "characters" in resp["error"]["message"], resp
    assert time.monotonic() - t < 2
    status, resp = post_json(plain + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500})  # fmt: skip
    assert status == 400 and "maximum context length is 128 tokens" in resp["error"]["message"]
    assert "500 output tokens" in resp["error"]["message"]
