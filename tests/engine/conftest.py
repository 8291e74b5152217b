"""Shared tiny checkpoints for engine tests (built once per session)."""

from __future__ import annotations

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
