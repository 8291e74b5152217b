"""Shared tiny checkpoints for engine tests (built once per session)."""

from __future__ import annotations

import threading

import pytest

from llmhal.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> (folder, hf_model); built lazily on first use of each arch."""
    cache: dict[str, tuple[str, object]] = {}

    def get(arch: str = "llama"):
        if arch not in cache:
            folder = tmp_path_factory.mktemp(f"tiny_{arch}")
            cache[arch] = (str(folder), make_tiny_model(folder, arch))
        return cache[arch]

    return get


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
