"""``llmhal serve -tp 2`` (issue 24): a two-rank engine behind the OpenAI server answers as one
process does, stops cleanly on SIGTERM, and when a rank dies mid-answer the client in flight gets
an error and the server exits with the rank's error, leaving no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from llmhal import LLM, SamplingParams
from llmhal.testing.processes import process_gone

BOUND_S = 20.0


def _workers(pid: int) -> list[int]:
    """The server's rank processes (multiprocessing's spawned children, not its resource
    tracker)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    found = []
    for child in map(int, out.stdout.split()):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                found.append(child)
    return found


def _serve(folder: str, *extra: str, tp: int = 2) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "llmhal.entrypoints.cli", "serve", "--model", folder,
           "--port", "0", "-tp", str(tp), "--kv-cache-memory-bytes", str(4 << 20), *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        m = re.search(r"llmhal serve: (http://\S+)/v1", line)
        if m:
            threading.Thread(target=lambda: [lines.append(x) for x in proc.stderr], daemon=True).start()  # fmt: skip
            proc.log = lines  # type: ignore[attr-defined]
            return proc, m.group(1)
    proc.wait()
    raise AssertionError("".join(lines)[-4000:])


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_tp2_serve_answers_as_one_process_and_stops_cleanly(tiny_models):
    folder, _ = tiny_models("llama")
    proc, base = _serve(folder)
    try:
        workers = _workers(proc.pid)
        got = _post(
            f"{base}/v1/completions",
            {"model": folder, "prompt": "The quick brown fox", "max_tokens": 8,
             "temperature": 0, "ignore_eos": True},
        )  # fmt: skip
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(BOUND_S) == 0
    finally:
        proc.kill()
    one = LLM(folder, kv_cache_memory_bytes=4 << 20)
    want = one.generate(
        ["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    assert got["choices"][0]["text"] == want[0].outputs[0].text
    assert workers and all(map(process_gone, workers))


@pytest.mark.slow
def test_pp2_serve_with_batches_in_flight_answers_as_one_process(tiny_models):
    """``llmhal serve -pp 2``: the server's engine keeps a batch per stage in flight; four prompts
    in one request are answered as one process answers them."""
    folder, _ = tiny_models("llama")
    prompts = ["The quick brown fox", "def add(a, b):", "1, 2, 3, 4,", "Once upon a time"]
    proc, base = _serve(folder, "-pp", "2", tp=1)
    try:
        body = {"model": folder, "prompt": prompts, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        got = _post(f"{base}/v1/completions", body)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(BOUND_S) == 0
    finally:
        proc.kill()
    one = LLM(folder, kv_cache_memory_bytes=4 << 20)
    want = one.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    texts = [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])]
    assert texts == [o.outputs[0].text for o in want]


@pytest.mark.slow
def test_a_rank_dying_mid_answer_errors_the_stream_and_stops_the_server(tiny_models):
    folder, _ = tiny_models("llama")
    proc, base = _serve(folder)
    try:
        workers = _workers(proc.pid)
        body = {"model": folder, "prompt": "The quick brown fox", "max_tokens": 400,
                "ignore_eos": True, "stream": True}  # fmt: skip
        req = urllib.request.Request(
            f"{base}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        events = []
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 3:  # streaming: kill rank 1 mid-answer
                    os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(BOUND_S) == 1
    finally:
        proc.kill()
    errors = [json.loads(e) for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and "rank 1" in errors[0]["error"]["message"], events[-3:]
    assert "rank 1 of the engine failed" in "".join(proc.log)  # type: ignore[attr-defined]
    assert all(map(process_gone, workers))


def test_serve_refuses_the_external_launcher(capsys):
    from llmhal.entrypoints.serve import main

    assert main(["--distributed-executor-backend", "external_launcher", "--port", "0"]) == 2
    assert "offline use" in capsys.readouterr().err
