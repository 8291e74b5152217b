"""Fixtures shared by every test folder."""

from __future__ import annotations

import pytest

from llmhal.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """``tiny_models(arch="llama", **config overrides)`` -> (folder, the transformers model): a
    tiny random checkpoint, built on first use of each (arch, overrides) and shared by every test
    of the session. Tests read it and never write into its folder."""
    cache: dict[str, tuple[str, object]] = {}

    def get(arch: str = "llama", **overrides):
        key = f"{arch}{sorted(overrides.items())}"
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"tiny_{arch}")
            cache[key] = (str(folder), make_tiny_model(folder, arch, **overrides))
        return cache[key]

    return get
