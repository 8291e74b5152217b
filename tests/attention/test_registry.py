"""The attention-backend registry: names, registration forms, lazy listing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmhal.attention import list_attention_backends, register_attention_backend
from llmhal.attention.reference import ReferenceAttentionBackend
from llmhal.attention.registry import (
    CORE_BACKENDS,
    _clear_registrations_for_tests,
    get_backend_entry,
    load_backend_class,
)

TEST_PREFIX = "test_registry_"


class DecoratedBackend(ReferenceAttentionBackend):
    name = "test_registry_decorated"


class NotABackend:
    pass


@pytest.fixture(autouse=True)
def _forget_test_registrations():
    yield
    _clear_registrations_for_tests(lambda name: name.startswith(TEST_PREFIX) or name == "reference")


def test_names_are_case_insensitive():
    path = "llmhal.attention.reference:ReferenceAttentionBackend"
    register_attention_backend("  TEST_REGISTRY_Upper ", path)
    for spelling in ("test_registry_upper", "TEST_REGISTRY_UPPER", "Test_Registry_Upper"):
        entry = get_backend_entry(spelling)
        assert entry is not None and entry.name == "test_registry_upper"
        assert entry.provider == "registered" and entry.class_path == path
    assert get_backend_entry("FLEX_ATTENTION").name == "flex_attention"


def test_decorator_form_registers_the_class_path():
    returned = register_attention_backend("TEST_REGISTRY_DECORATED")(DecoratedBackend)
    assert returned is DecoratedBackend
    entry = get_backend_entry("test_registry_decorated")
    assert entry.class_path == f"{DecoratedBackend.__module__}:DecoratedBackend"
    assert load_backend_class(entry) is DecoratedBackend


def test_registration_with_kind_and_override_of_a_core_name():
    register_attention_backend(
        "test_registry_mamba", "llmhal.attention.reference:ReferenceAttentionBackend", kind="mamba2"
    )
    assert get_backend_entry("test_registry_mamba").kind == "mamba2"
    # The last registration of a name wins, over core's too.
    register_attention_backend("reference", f"{__name__}:DecoratedBackend")
    entry = get_backend_entry("reference")
    assert entry.provider == "registered" and entry.class_path.endswith(":DecoratedBackend")


def test_loading_something_that_is_not_a_backend_says_so():
    register_attention_backend("test_registry_bad", f"{__name__}:NotABackend")
    with pytest.raises(TypeError, match="is not an AttentionBackend subclass"):
        load_backend_class(get_backend_entry("test_registry_bad"))


def test_core_backends_are_listed_with_their_kind():
    entries = {e.name: e for e in list_attention_backends()}
    for name, (path, kind) in CORE_BACKENDS.items():
        assert entries[name].class_path == path and entries[name].kind == kind
    assert load_backend_class(entries["tree_attn"]).kind == "tree"


_LISTING = r"""
import json, sys
from llmhal.attention import list_attention_backends
entries = list_attention_backends()
heavy = ("llmhal.attention.flex_attention", "llmhal.attention.reference", "llmhal.attention.tree_attn",
         "llmhal.attention.triton_attn", "llmhal.attention.triton_kernels", "llmhal_cpu.attention",
         "llmhal_cuda.attention", "llmhal_rocm.attention", "triton", "flash_attn", "flashinfer")
loaded = sorted(m for m in sys.modules if m.startswith(heavy))
print("LISTING" + json.dumps({"names": sorted(e.name for e in entries), "loaded": loaded}))
"""


def test_listing_imports_no_backend_module():
    proc = subprocess.run(
        [sys.executable, "-c", _LISTING], capture_output=True, text=True, timeout=300
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("LISTING")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    result = json.loads(line[0].removeprefix("LISTING"))
    assert set(CORE_BACKENDS) <= set(result["names"])
    assert result["loaded"] == []
