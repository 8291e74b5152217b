"""Selecting an attention backend: explicit choices, kind narrowing, the priority walk, errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llmhal.attention import register_attention_backend
from llmhal.attention.backend import AttentionRequirements
from llmhal.attention.reference import ReferenceAttentionBackend
from llmhal.attention.registry import _clear_registrations_for_tests
from llmhal.attention.selector import (
    AttentionBackendError,
    _clear_cache_for_tests,
    select_attention_backend,
)
from llmhal.platforms import Platform, get_current_platform, set_current_platform

REQ = AttentionRequirements(head_size=64, num_heads=8, num_kv_heads=2, dtype=torch.bfloat16)


class FakeMamba2Backend(ReferenceAttentionBackend):
    name = "fake_mamba2"
    kind = "mamba2"


class _FakePlatform(Platform):
    name = "fakeplat"
    device_name = "fake device"
    device_type = "cpu"

    def __init__(self, order: list[str]) -> None:
        self.order = order

    def attention_backend_priority(self, requirements):
        return list(self.order)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    before = get_current_platform()
    _clear_cache_for_tests()
    yield
    set_current_platform(before)
    _clear_registrations_for_tests(lambda n: n == "fake_mamba2")
    _clear_cache_for_tests()


@pytest.fixture
def fake_platform():
    def use(*order: str) -> _FakePlatform:
        p = _FakePlatform(list(order))
        set_current_platform(p)
        return p

    return use


@pytest.fixture
def cpu_platform():
    platform = get_current_platform()
    if platform.name != "cpu":
        pytest.skip(f"needs the cpu platform (active: {platform.name})")
    return platform


# ------------------------------------------------------------------------------ explicit choice
def test_explicit_choice_is_honoured_case_insensitively(fake_platform):
    fake_platform("flex_attention", "reference")
    sel = select_attention_backend(REQ, explicit="REFERENCE")
    assert sel.name == "reference" and sel.backend is ReferenceAttentionBackend
    assert sel.selected_by == "config" and sel.reason == "attention_backend=REFERENCE"


def test_explicit_choice_is_rejected_with_every_reason_never_replaced(fake_platform):
    fake_platform("flex_attention", "reference")
    req = replace(REQ, sliding_window=64, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(AttentionBackendError) as err:
        select_attention_backend(req, explicit="tree_attn")
    msg = str(err.value)
    assert "Attention backend 'tree_attn' (attention_backend=tree_attn)" in msg
    assert "on the fakeplat platform" in msg and "kv_cache_dtype=fp8_e4m3" in msg
    assert "  - serves tree layers, not mha\n" in msg
    assert "  - sliding window not supported\n" in msg
    # reference works here (flex does not store fp8); triton_attn only with a Triton device.
    assert "Backends that work here: reference" in msg
    assert "flex_attention" not in msg.split("Backends that work here:")[1]


def test_unknown_explicit_choice_lists_known_names(fake_platform):
    fake_platform("reference")
    with pytest.raises(AttentionBackendError, match="unknown backend; known backends: .*reference"):
        select_attention_backend(REQ, explicit="no_such_backend")


def test_config_choice_beats_the_environment(fake_platform, monkeypatch):
    fake_platform("reference")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "flex_attention")
    assert select_attention_backend(REQ).name == "flex_attention"
    assert select_attention_backend(REQ).selected_by == "VLLM_ATTENTION_BACKEND"
    assert select_attention_backend(REQ, explicit="reference").name == "reference"


# ------------------------------------------------------------------------------- priority walk
def test_priority_walk_takes_the_first_valid_and_records_the_rest(fake_platform):
    fake_platform("tree_attn", "flex_attention", "reference")
    req = replace(REQ, kv_cache_dtype="fp8_e5m2")
    sel = select_attention_backend(req)
    assert sel.name == "reference" and sel.selected_by == "priority"
    # tree_attn is another kind: narrowed away, not "rejected"
    assert [name for name, _ in sel.rejected] == ["flex_attention"]
    assert sel.rejected[0][1] == ("kv_cache_dtype fp8_e5m2 not supported (supported: auto)",)
    assert "first valid backend in the fakeplat platform's priority list" in sel.reason
    assert "skipped flex_attention (kv_cache_dtype fp8_e5m2" in sel.reason


def test_kind_narrows_candidates_to_registered_backends_of_that_kind(fake_platform):
    fake_platform("flex_attention", "reference")
    register_attention_backend("fake_mamba2", f"{__name__}:FakeMamba2Backend", kind="mamba2")
    sel = select_attention_backend(replace(REQ, kind="mamba2"))
    assert sel.name == "fake_mamba2" and sel.backend is FakeMamba2Backend
    # and an attention layer never gets the mamba backend, even when the platform ranks it first
    fake_platform("fake_mamba2", "reference")
    assert select_attention_backend(REQ).name == "reference"


def test_no_valid_backend_lists_each_candidate(fake_platform):
    fake_platform("flex_attention", "reference", "not_a_backend")
    req = replace(REQ, dtype=torch.float64)
    with pytest.raises(AttentionBackendError) as err:
        select_attention_backend(req)
    msg = str(err.value)
    assert msg.startswith("No attention backend on the fakeplat platform can serve this model")
    assert "  - flex_attention: dtype float64 not supported" in msg
    assert (
        "  - reference: dtype float64 not supported (supported: float32, bfloat16, float16)" in msg
    )
    assert "Install a platform package" in msg


# ------------------------------------------------------------- VLLM_ATTENTION_BACKEND on the CPU
@pytest.mark.parametrize("name", ["flex_attention", "cpu_attn", "CPU_ATTN"])
def test_environment_choice_is_honoured_on_cpu(cpu_platform, monkeypatch, name):
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", name)
    sel = select_attention_backend(REQ)
    assert sel.name == name.lower() and sel.selected_by == "VLLM_ATTENTION_BACKEND"
    assert sel.reason == f"VLLM_ATTENTION_BACKEND={name}"


def test_flash_attn_on_cpu_names_the_platform_the_reason_and_the_alternatives(
    cpu_platform, monkeypatch
):
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "flash_attn")
    with pytest.raises(AttentionBackendError) as err:
        select_attention_backend(REQ)
    msg = str(err.value)
    assert (
        "Attention backend 'flash_attn' (VLLM_ATTENTION_BACKEND=flash_attn) cannot be used on "
        "the cpu platform" in msg
    )
    assert "provided by the cuda platform, which is not active here" in msg
    usable = msg.split("Backends that work here:")[1]
    for alternative in ("cpu_attn", "flex_attention", "reference"):
        assert alternative in usable
    assert "flash_attn" not in usable and "tree_attn" not in usable


def test_default_cpu_selection_is_cpu_attn(cpu_platform):
    sel = select_attention_backend(REQ)
    assert sel.name == "cpu_attn" and sel.selected_by == "priority"
