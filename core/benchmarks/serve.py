"""``llmhal bench serve``: an OpenAI-compatible server under load, in vLLM's ``benchmark_serving``
style: throughput, time to first token and inter-token latency (p50/p99) at each concurrency.

At concurrency C, C clients each stream completions back to back (a closed loop) until
``--num-prompts`` (default 2 x C, at least 8) have finished. Every prompt is distinct (no prefix
cache hits) and about ``--input-len`` tokens of plain words; each asks for ``--output-len`` tokens
with ``ignore_eos`` (vLLM's rule), greedy. TTFT is the time from sending a request to its first
streamed text; inter-token latency is each later gap between streamed chunks, divided by the
tokens the chunk carries. Percentiles are taken over every request's gaps together, interpolated
as numpy's (vLLM's ``np.percentile``). Output throughput counts generated tokens over the wall
time of the run at that concurrency. Each level also records the 1-minute load average before
and after it: on a shared machine the figures mean little without it.

Point it at a running server with ``--base-url`` (any server with vLLM's /v1/completions, so two
builds can be compared in one session), or leave it out to start ``llmhal serve`` (with the
engine options given) on a free port in a process of its own for the run. Apart, as vLLM's
benchmark runs apart from the server it measures: in one process the client threads (one per
stream, each parsing every chunk) share the server's interpreter lock, and the engine thread
waits for it between its native calls, a cost that grows with the concurrency being measured
(measured on the default model at 16 streams: 0.15 ms of client CPU per chunk, a few percent of
the engine thread's time).
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
         "case point number group problem fact water room mother area money story night").split()  # fmt: skip


# Requests per level at least (default): at concurrency 1, 16 requests give ~500 gaps, so the p99
# the other levels are compared with is not one or two stray gaps (with 8, it was the 3rd largest
# of 248, and varied 17-24 ms between runs on an idle machine).
MIN_PROMPTS = 16


@dataclass
class Result:
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


def _prompt(i: int, words: int) -> str:
    body = " ".join(WORDS[(i * 7 + k * 13 + k * k) % len(WORDS)] for k in range(words))
    return f"Request {i}: {body}"


def _one(url: urllib.parse.SplitResult, body: dict[str, Any], timeout: float) -> Result:
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    r = Result()
    t0 = time.perf_counter()
    try:
        conn.request("POST", url.path.rstrip("/") + "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        if resp.status != 200:
            r.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return r
        last = None
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                r.error = event["error"]["message"]
                break
            if not event.get("choices"):
                continue
            choice = event["choices"][0]
            n = len(choice.get("logprobs", {}).get("tokens", [])) if choice.get("logprobs") else 1
            now = time.perf_counter()
            if last is None:
                r.ttft = now - t0
            elif n:
                r.gaps += [(now - last) / n] * n
            last = now
            r.tokens += n
    except OSError as e:
        r.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return r


def _pct(xs: list[float], q: float) -> float:
    """numpy's default percentile (linear between the two nearest ranks), as vLLM reports."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    pos = q / 100 * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _load() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run_level(base_url: str, concurrency: int, num_prompts: int, input_len: int, output_len: int, offset: int, timeout: float = 600) -> dict[str, Any]:  # fmt: skip
    """C closed-loop clients until ``num_prompts`` requests finished; the figures of that run."""
    url = urllib.parse.urlsplit(base_url)
    results: list[Result] = []
    lock = threading.Lock()
    counter = iter(range(num_prompts))

    def client() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            body = {"prompt": _prompt(offset + i, input_len), "max_tokens": output_len,
                    "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 0}  # fmt: skip
            r = _one(url, body, timeout)
            with lock:
                results.append(r)

    load_before = _load()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if not r.error]
    gaps = [g for r in ok for g in r.gaps]
    ttfts = [r.ttft for r in ok]
    tokens = sum(r.tokens for r in ok)
    return {
        "concurrency": concurrency, "requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3], "wall_s": wall,
        "output_tok_s": tokens / wall, "req_s": len(ok) / wall,
        "ttft_p50_ms": 1000 * _pct(ttfts, 50), "ttft_p99_ms": 1000 * _pct(ttfts, 99),
        "itl_p50_ms": 1000 * _pct(gaps, 50), "itl_p99_ms": 1000 * _pct(gaps, 99),
        "itl_mean_ms": 1000 * statistics.fmean(gaps) if gaps else float("nan"),
        "load_before": load_before, "load_after": _load(),
    }  # fmt: skip


def table(rows: list[dict[str, Any]], label: str = "") -> str:
    head = f"{'':10}{'conc':>5} {'reqs':>5} {'fail':>5} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'load':>9}"  # fmt: skip
    lines = [head]
    for r in rows:
        load = "/".join("?" if x is None else f"{x:.1f}" for x in (r.get("load_before"), r.get("load_after")))  # fmt: skip
        lines.append(
            f"{label:10}{r['concurrency']:>5} {r['requests']:>5} {r['failed']:>5} {r['output_tok_s']:>10.1f} "
            f"{r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms {r['itl_p50_ms']:>6.0f}ms {r['itl_p99_ms']:>6.0f}ms {load:>9}"
        )  # fmt: skip
    return "\n".join(lines)


def serve_apart(engine_argv: list[str], timeout: float = 600) -> tuple[subprocess.Popen[str], str]:
    """``llmhal serve`` (``engine_argv`` its engine options) on a free port in a process of its
    own, and its base URL once it listens; RuntimeError with the server's last words if it exits
    or stays silent first."""
    cmd = [sys.executable, "-m", "llmhal.entrypoints.cli", "serve", "--port", "0", "--disable-log-requests", *engine_argv]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    said: collections.deque[str] = collections.deque(maxlen=20)
    found: list[str] = []

    def read() -> None:  # until the server exits: a full pipe would block it
        assert proc.stderr is not None
        for line in proc.stderr:
            said.append(line)
            m = re.search(r"llmhal serve: (http://\S+)/v1 ", line)
            if m and not found:
                found.append(m.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not found:
        code = proc.poll()
        why = f"exited with status {code}" if code is not None else f"did not listen within {timeout:.0f} s"  # fmt: skip
        stop_apart(proc)
        raise RuntimeError(f"the server ({' '.join(cmd[3:])}) {why}:\n{''.join(said).rstrip()}")
    return proc, found[0]


def stop_apart(proc: subprocess.Popen[str]) -> None:
    """End a server from :func:`serve_apart` as Ctrl-C would (SIGTERM), killing it if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="llmhal bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running server (default: start llmhal serve for the run)")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated levels (default 1,4,16)")  # fmt: skip
    p.add_argument(
        "--num-prompts", type=int, help=f"requests per level (default max({MIN_PROMPTS}, 2 x C))"
    )
    p.add_argument("--input-len", type=int, default=200, help="prompt words, about tokens (200)")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request (32)")
    p.add_argument("--label", default="", help="a name for this server in the table")
    p.add_argument(
        "--first-prompt", type=int, default=0,
        help="number prompts from here (runs against one server then share no prefix)",
    )  # fmt: skip
    p.add_argument("--json", dest="json_path", help="also write the results here")
    known, rest = p.parse_known_args(argv)
    server = None
    base = known.base_url
    if base is None:
        try:
            server, base = serve_apart(rest)
        except RuntimeError as e:
            print(f"llmhal bench serve: {e}", file=sys.stderr)
            return 2
    elif rest:
        p.error(f"unrecognized arguments: {' '.join(rest)} (engine options need no --base-url)")
    try:
        return _run_levels(known, base)
    finally:
        if server is not None:
            stop_apart(server)


def _run_levels(known: argparse.Namespace, base: str) -> int:
    levels = [int(c) for c in known.concurrency.split(",") if c.strip()]
    # One untimed request first: first-use costs (allocation, page faults) stay out of the table.
    run_level(base, 1, 1, known.input_len, 4, offset=10**6)
    rows, offset = [], known.first_prompt
    for c in levels:
        n = known.num_prompts or max(MIN_PROMPTS, 2 * c)
        rows.append(run_level(base, c, n, known.input_len, known.output_len, offset))
        offset += n
        print(table(rows[-1:], known.label).splitlines()[-1], file=sys.stderr, flush=True)
    print(table(rows, known.label))
    if known.json_path:
        with open(known.json_path, "w") as f:
            json.dump({"label": known.label, "base_url": base, "input_len": known.input_len,
                       "output_len": known.output_len, "rows": rows}, f, indent=1)  # fmt: skip
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
