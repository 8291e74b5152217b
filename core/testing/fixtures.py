"""Pytest fixtures for plugin and platform tests; import them into a ``conftest.py``::

    from llmhal.testing.fixtures import install_dists, markers  # noqa: F401

``markers``: a folder that modules built with ``marker_code`` write to (also set in the environment).
``install_dists``: ``install_dists(*FakeDistribution) -> Path`` builds the distributions and makes them
visible to this process with a fresh plugin state (see :mod:`llmhal.testing.isolation`); everything
is restored after the test. ``VLLM_PLUGINS``/``VLLM_PLATFORM`` are unset for the test either way.

:func:`live_platform` (a helper, not a fixture) is the gate of ``gpu``-marked tests on real hardware.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from llmhal.testing.distributions import MARKER_DIR_ENV, FakeDistribution, build_distributions
from llmhal.testing.isolation import fresh_plugin_state

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.platforms import Platform


def live_platform(name: str, device_present: bool, device: str) -> Platform:
    """The active platform, for a test on real hardware; skips the test, saying why, when no
    ``device`` (e.g. "CUDA") is present or the active platform is not ``name``."""
    from llmhal.platforms import get_current_platform

    if not device_present:
        pytest.skip(f"no {device} device")
    platform = get_current_platform()
    if platform.name != name:
        pytest.skip(f"the active platform is {platform.name}, not {name}")
    return platform


@pytest.fixture
def markers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "markers"
    folder.mkdir()
    monkeypatch.setenv(MARKER_DIR_ENV, str(folder))
    return folder


@pytest.fixture
def install_dists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    for var in ("VLLM_PLUGINS", "VLLM_PLATFORM", "VLLM_ATTENTION_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    with ExitStack() as stack:
        count = 0

        def install(*dists: FakeDistribution) -> Path:
            nonlocal count
            count += 1
            root = build_distributions(tmp_path / f"dists{count}", *dists)
            stack.enter_context(fresh_plugin_state(root))
            return root

        yield install
