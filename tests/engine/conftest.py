"""Servers over the shared tiny checkpoints (``tiny_models``, in tests/conftest.py)."""

from __future__ import annotations

import threading

import pytest


@pytest.fixture(scope="module")
def server(tiny_models):
    """``llmhal serve`` on the tiny llama (served as "tiny", max_model_len 128), in a thread:
    (base URL, the LLM behind it)."""
    from llmhal import LLM
    from llmhal.entrypoints.serve import build_server

    folder, _ = tiny_models("llama")
    llm = LLM(folder, dtype="float32", max_model_len=128)
    srv = build_server(llm, "127.0.0.1", 0, model_name="tiny")
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", llm
    srv.shutdown()
    srv.server_close()
    srv.state.loop.shutdown()
