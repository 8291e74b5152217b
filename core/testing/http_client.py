"""A JSON client for tests of ``llmhal serve`` (stdlib only), and a server to run it against."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def post_json(url: str, body: dict[str, Any], stream: bool = False, timeout: float = 120, headers: dict[str, str] | None = None) -> tuple[int, Any]:  # fmt: skip
    """POST ``body``; (status, the JSON answer), or for ``stream`` (200, the list of server-sent
    events' JSON objects, ``[DONE]`` left out). An HTTP error gives (its status, its JSON body)."""
    headers = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if not stream:
        return 200, json.loads(data)
    events = [line[6:] for line in data.splitlines() if line.startswith("data: ")]
    return 200, [json.loads(e) for e in events if e != "[DONE]"]


class running_server:
    """``with running_server(llm, **build_server_kwargs) as (base_url, server):`` ``llmhal
    serve`` on a free local port, in a thread, stopped (with its engine loop) on exit."""

    def __init__(self, llm: Any, **kwargs: Any) -> None:
        self.llm, self.kwargs = llm, kwargs

    def __enter__(self) -> tuple[str, Any]:
        import threading

        from llmhal.entrypoints.serve import build_server

        self.server = build_server(self.llm, "127.0.0.1", 0, **self.kwargs)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}", self.server

    def __exit__(self, *exc: Any) -> None:
        from llmhal.entrypoints.serve import shutdown_server

        shutdown_server(self.server, grace_s=2)
