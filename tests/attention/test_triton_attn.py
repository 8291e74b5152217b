"""triton_attn: the unified kernel against the reference.

Without a Triton-capable device the kernel runs in Triton's CPU interpreter, which triton reads
from ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when ``triton_kernels`` is first
imported. These tests therefore run it in a subprocess with ``TRITON_INTERPRET=1``, leaving this
process (and other tests' Triton kernels) untouched. The interpreter is slow: a handful of small
cases by default, more under ``slow``; the full sweep runs compiled on a GPU (``gpu``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from llmhal.attention.backend import AttentionRequirements
from llmhal.attention.triton_attn import TritonAttentionBackend
from llmhal.platforms import get_current_platform
from llmhal.testing.attention_conformance import (
    AttentionCase,
    check_attention_case,
    conformance_cases,
)

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

_RUNNER = r"""
import json, sys
from llmhal.attention.triton_attn import TritonAttentionBackend
from llmhal.attention import triton_kernels
from llmhal.testing.attention_conformance import AttentionCase, run_attention_case
assert triton_kernels.interpreter_active(), "TRITON_INTERPRET=1 was not honoured"
out = []
for spec in json.loads(sys.stdin.read()):
    spec["requests"] = tuple(tuple(r) for r in spec["requests"])
    r = run_attention_case(TritonAttentionBackend, AttentionCase(**spec))
    out.append({"id": r.case.id, "skipped": r.skipped, "failures": r.failures, "err": r.max_abs_err})
print("RESULTS" + json.dumps(out))
"""


def _run_interpreted(cases: list[AttentionCase]) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps([dataclasses.asdict(c) for c in cases]),
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[0].removeprefix("RESULTS"))


def _assert_all_pass(results: list[dict]) -> None:
    bad = [r for r in results if r["failures"] or r["skipped"]]
    assert not bad, json.dumps(bad, indent=1)


# Small on purpose: the interpreter executes every program in Python.
_SMALL = ((11, 1), (24, 1), (9, 6), (0, 13))
INTERPRETED_QUICK = [
    AttentionCase(64, 4, 4, "float32", requests=_SMALL, seed=1),
    AttentionCase(128, 8, 2, "bfloat16", block_size=32, sliding_window=7, requests=_SMALL, seed=2),
    AttentionCase(
        80, 8, 1, "float16", logits_soft_cap=1.5, kv_cache_dtype="fp8_e4m3", requests=_SMALL, seed=3
    ),
    AttentionCase(64, 9, 3, "float32", kv_cache_dtype="fp8_e5m2", requests=_SMALL, seed=4),
]


def test_triton_interpreted_conformance():
    _assert_all_pass(_run_interpreted(INTERPRETED_QUICK))


@pytest.mark.slow
def test_triton_interpreted_quick_suite_all_dtypes():
    cases = conformance_cases(TritonAttentionBackend, dtypes=("float32", "bfloat16", "float16"))
    _assert_all_pass(_run_interpreted(cases))


# ------------------------------------------------------------------------------- availability
def test_availability_names_the_interpreter(monkeypatch):
    platform = get_current_platform()
    if platform.capabilities.triton:
        pytest.skip("this platform runs Triton kernels natively")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reasons = TritonAttentionBackend.availability(platform)
    assert len(reasons) == 1
    assert f"the {platform.name} platform cannot run Triton kernels" in reasons[0]
    assert "TRITON_INTERPRET=1" in reasons[0]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonAttentionBackend.availability(platform) == []


def test_availability_without_triton(monkeypatch):
    import llmhal.attention.triton_attn as mod

    monkeypatch.setattr(mod, "is_available", lambda name: name != "triton")
    assert TritonAttentionBackend.availability(get_current_platform()) == [
        "the triton package is not installed (pip install triton)"
    ]


def test_validate_block_sizes():
    req = AttentionRequirements(64, 4, 4, torch.float16, block_size=8)
    assert TritonAttentionBackend.validate(req) == [
        "block_size 8 not supported (supported: multiple of 16)"
    ]


# ------------------------------------------------------------------------------------ devices
def _triton_device() -> torch.device | None:
    platform = get_current_platform()
    return platform.torch_device() if platform.capabilities.triton else None


GPU_CASES = conformance_cases(
    TritonAttentionBackend, dtypes=("float32", "bfloat16", "float16"), quick=False
)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_triton_compiled_full_sweep(case):
    device = _triton_device()
    if device is None:
        pytest.skip("no platform here runs Triton kernels natively (needs a GPU)")
    check_attention_case(TritonAttentionBackend, case, device=device)
