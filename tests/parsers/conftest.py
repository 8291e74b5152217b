"""The parser suites' fixtures: the cases of tool_cases.py and reasoning_cases.py (loaded from
their files: tests are imported without a package), the suites parametrized with them, and one
tokenizer that knows every family's markers as special tokens."""

from __future__ import annotations

import importlib.util
import sys
import zlib
from pathlib import Path
from types import ModuleType

import pytest


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"parser_suite_{name}", Path(__file__).with_name(f"{name}.py"))  # fmt: skip
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


TOOL = _load("tool_cases")
REASONING = _load("reasoning_cases")


def _id(case) -> str:
    return f"{case.parser}-{zlib.crc32(case.text.encode()) % 10_000:04d}"


def pytest_generate_tests(metafunc):
    if "tool_case" in metafunc.fixturenames:
        metafunc.parametrize("tool_case", TOOL.CASES, ids=[_id(c) for c in TOOL.CASES])
    if "tool_family" in metafunc.fixturenames:
        metafunc.parametrize("tool_family", sorted(TOOL.TEMPLATES))
    if "reasoning_case" in metafunc.fixturenames:
        metafunc.parametrize("reasoning_case", REASONING.CASES, ids=[_id(c) for c in REASONING.CASES])  # fmt: skip
    if "reasoning_family" in metafunc.fixturenames:
        metafunc.parametrize("reasoning_family", sorted({c.parser for c in REASONING.CASES}))


@pytest.fixture(scope="session")
def tool_cases() -> ModuleType:
    return TOOL


@pytest.fixture(scope="session")
def reasoning_cases() -> ModuleType:
    return REASONING


@pytest.fixture(scope="session")
def tok():
    """The tiny test tokenizer with every family's markers as special tokens (as they are in
    the families' own vocabularies), and <think>/</think> added as R1's are."""
    from llmhal.testing.tiny_models import make_tokenizer

    t = make_tokenizer()
    t.add_special_tokens({"additional_special_tokens": TOOL.SPECIAL_TOKENS + REASONING.SPECIAL_TOKENS})  # fmt: skip
    t.add_tokens(["<think>", "</think>"])
    return t
