"""Backends selected by layer kind: recurrent layers get a backend of their kind, an explicit
VLLM_ATTENTION_BACKEND applies to the layers of its own kind and is refused when it serves none of
the model's layers, a platform without a backend for a kind is an error at load, and the doctor
lists backends by kind."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llmhal import LLM
from llmhal.attention import register_attention_backend
from llmhal.attention import registry as attn_registry
from llmhal.attention.backend import AttentionRequirements
from llmhal.attention.registry import _clear_registrations_for_tests
from llmhal.attention.selector import (
    AttentionBackendError,
    _clear_cache_for_tests,
    select_attention_backend,
)
from llmhal.attention.state import (
    RecurrentBackend,
    check_explicit_choice,
    select_recurrent_backend,
)

MAMBA2 = AttentionRequirements(
    head_size=16, num_heads=8, num_kv_heads=8, dtype=torch.float32, kind="mamba2"
)
MHA = AttentionRequirements(head_size=16, num_heads=4, num_kv_heads=2, dtype=torch.float32)


class PluginMamba2Backend(RecurrentBackend):
    name = "plugin_mamba2"
    kind = "mamba2"


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    _clear_cache_for_tests()
    yield
    _clear_registrations_for_tests(lambda n: n == "plugin_mamba2")
    _clear_cache_for_tests()


def test_each_recurrent_kind_gets_its_core_backend():
    for kind, name in (("mamba1", "mamba1_attn"), ("mamba2", "mamba2_attn")):
        sel = select_recurrent_backend(replace(MAMBA2, kind=kind), None)
        assert sel.name == name and sel.selected_by == "priority"


def test_a_platform_or_plugin_backend_of_the_kind_beats_cores():
    register_attention_backend("plugin_mamba2", f"{__name__}:PluginMamba2Backend", kind="mamba2")
    assert select_recurrent_backend(MAMBA2, None).name == "plugin_mamba2"


def test_an_explicit_choice_of_another_kind_leaves_recurrent_layers_to_their_kind(monkeypatch):
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "flex_attention")
    mamba = select_recurrent_backend(MAMBA2, None)
    assert mamba.name == "mamba2_attn"
    attn = select_attention_backend(MHA)
    assert attn.name == "flex_attention"
    check_explicit_choice([attn, mamba], None)  # a hybrid: the choice serves its attention layers
    with pytest.raises(AttentionBackendError) as e:
        check_explicit_choice([mamba], None)  # a pure Mamba-2 model: it serves nothing
    msg = str(e.value)
    assert "'flex_attention'" in msg and "serves mha layers" in msg
    assert "kind mamba2" in msg and "mamba2: mamba2_attn" in msg


def test_an_explicit_recurrent_choice_is_validated_for_the_layer():
    assert select_recurrent_backend(MAMBA2, "MAMBA2_ATTN").selected_by == "config"
    # A recurrent backend asked for attention layers is refused with what works instead.
    with pytest.raises(AttentionBackendError, match="serves mamba2 layers, not mha"):
        select_attention_backend(MHA, explicit="mamba2_attn")


def test_no_backend_for_the_kind_is_an_error_naming_the_kinds(monkeypatch):
    monkeypatch.delitem(attn_registry.CORE_BACKENDS, "mamba2_attn")
    with pytest.raises(AttentionBackendError) as e:
        select_recurrent_backend(MAMBA2, None)
    msg = str(e.value)
    assert "No attention backend of kind 'mamba2'" in msg
    assert "mamba1: mamba1_attn" in msg and "register_attention_backend" in msg


def test_a_pure_mamba_model_refuses_a_backend_of_another_kind_at_load(tiny_models, monkeypatch):
    folder = tiny_models("mamba2")[0]
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "mamba1_attn")
    with pytest.raises(AttentionBackendError, match=r"serves mamba1 layers.*mamba2: mamba2_attn"):
        LLM(folder, dtype="float32")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "mamba2_attn")
    llm = LLM(folder, dtype="float32")
    assert llm.engine.runner.attention_backends == ["mamba2_attn"]


def test_doctor_lists_backends_by_kind():
    from llmhal import doctor

    report = doctor.collect()
    kinds = {b["name"]: b["kind"] for b in report["attention_backends"]}
    assert kinds["mamba1_attn"] == "mamba1" and kinds["mamba2_attn"] == "mamba2"
    assert kinds["flex_attention"] == "mha"
    text = doctor.format_report(report)
    assert "prefix caching is off for models with such layers" in text
