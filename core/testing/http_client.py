"""A JSON client for tests of ``llmhal serve`` (stdlib only)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def post_json(url: str, body: dict[str, Any], stream: bool = False, timeout: float = 120) -> tuple[int, Any]:  # fmt: skip
    """POST ``body``; (status, the JSON answer), or for ``stream`` (200, the list of server-sent
    events' JSON objects, ``[DONE]`` left out). An HTTP error gives (its status, its JSON body)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if not stream:
        return 200, json.loads(data)
    events = [line[6:] for line in data.splitlines() if line.startswith("data: ")]
    return 200, [json.loads(e) for e in events if e != "[DONE]"]
