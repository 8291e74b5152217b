"""General plugins: plain callables and pluggy hook modules, validated against the hookspecs."""

from __future__ import annotations

import threading

import pytest

import llmhal.plugins as plugins
from llmhal.testing.distributions import FakeDistribution, marker_code, marker_count
from llmhal.testing.fake_vendor import GENERAL


def _general(name: str, source: str, value: str | None = None) -> FakeDistribution:
    return FakeDistribution(
        f"{name}-dist",
        "1.0",
        entry_points={GENERAL: {name: value or f"{name}_mod"}},
        modules={f"{name}_mod.py": marker_code(f"{name}_mod") + source},
    )


HOOKS = """
from llmhal.plugins.hookspecs import hookimpl


@hookimpl
def llmhal_register_models(registry):
    registry.register_model("HookedForCausalLM", "hooked_mod:HookedForCausalLM")


@hookimpl
def llmhal_register_attention_backends(register):
    register("HOOKED_ATTN", "hooked_mod:HookedBackend")


@hookimpl
def llmhal_register_quantization_configs(register):
    register("hooked_quant", "hooked_mod:HookedQuant")


@hookimpl
def llmhal_register_ops(register):
    register("silu_and_mul", "hooked_mod:silu_and_mul")
"""


def _record(name: str) -> plugins.PluginRecord:
    return {r.name: r for r in plugins.plugin_records()}[name]


def test_plain_callable_runs_once(install_dists, markers):
    source = "RUNS = []\n\n\ndef register():\n    RUNS.append(1)\n"
    install_dists(_general("plain", source, "plain_mod:register"))
    plugins.load_general_plugins()
    plugins.load_general_plugins()
    import plain_mod  # the plugin module, imported from the throwaway folder

    assert plain_mod.RUNS == [1]
    assert marker_count(markers, "plain_mod") == 1
    assert _record("plain").status == plugins.LOADED


def test_plain_callable_runs_once_from_two_threads(install_dists, markers):
    source = (
        "import time\n\nCOUNT = []\n\n\ndef register():\n    time.sleep(0.2)\n    COUNT.append(1)\n"
    )
    install_dists(_general("slow", source, "slow_mod:register"))
    barrier = threading.Barrier(2)

    def call() -> None:
        barrier.wait()
        plugins.load_general_plugins()

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    import slow_mod

    assert slow_mod.COUNT == [1]


def test_hook_module_registers_everything(install_dists):
    from llmhal.attention.registry import get_backend_entry
    from llmhal.models.registry import ModelRegistry
    from llmhal.ops.registry import _registered as registered_ops
    from llmhal.quantization.registry import get_method_entry

    install_dists(_general("hooked", HOOKS))
    plugins.load_general_plugins()
    assert _record("hooked").status == plugins.LOADED
    assert ModelRegistry.is_registered("HookedForCausalLM")
    attn = get_backend_entry("hooked_attn")
    assert attn is not None and attn.class_path == "hooked_mod:HookedBackend"
    quant = get_method_entry("hooked_quant")
    assert quant is not None and quant.class_path == "hooked_mod:HookedQuant"
    assert registered_ops["silu_and_mul"] == "hooked_mod:silu_and_mul"


def test_bad_hook_signature_is_rejected_naming_plugin_and_hook(install_dists):
    bad = "from llmhal.plugins.hookspecs import hookimpl\n\n\n@hookimpl\ndef llmhal_register_models(registry, surprise):\n    pass\n"
    install_dists(_general("badsig", bad))
    plugins.load_general_plugins()
    rec = _record("badsig")
    assert rec.status == plugins.FAILED
    assert "'badsig'" in rec.reason and "llmhal_register_models" in rec.reason
    assert "surprise" in rec.reason


def test_unknown_hook_is_rejected(install_dists):
    bad = "from llmhal.plugins.hookspecs import hookimpl\n\n\n@hookimpl\ndef llmhal_register_widgets(register):\n    pass\n"
    install_dists(_general("unknownhook", bad))
    plugins.load_general_plugins()
    rec = _record("unknownhook")
    assert rec.status == plugins.FAILED
    assert "llmhal_register_widgets" in rec.reason and "llmhal_register_models" in rec.reason


def test_bad_hook_in_an_explicit_plugin_is_an_error(install_dists, monkeypatch):
    bad = "from llmhal.plugins.hookspecs import hookimpl\n\n\n@hookimpl\ndef llmhal_register_ops(reg):\n    pass\n"
    install_dists(_general("explicitbad", bad))
    monkeypatch.setenv("VLLM_PLUGINS", "explicitbad")
    with pytest.raises(plugins.PluginLoadError, match="explicitbad.*llmhal_register_ops"):
        plugins.load_general_plugins()


def test_object_neither_callable_nor_hooks_is_rejected(install_dists):
    install_dists(_general("notcallable", "VALUE = 3\n", "notcallable_mod:VALUE"))
    plugins.load_general_plugins()
    rec = _record("notcallable")
    assert rec.status == plugins.FAILED and "zero-argument callable" in rec.reason


def test_raising_callable_and_raising_hook_are_recorded(install_dists):
    install_dists(
        _general(
            "raiser", "def register():\n    raise KeyError('no device')\n", "raiser_mod:register"
        ),
        _general(
            "hookraiser",
            "from llmhal.plugins.hookspecs import hookimpl\n\n\n@hookimpl\n"
            "def llmhal_register_ops(register):\n    register('no_such_op', 'x:y')\n",
        ),
    )
    plugins.load_general_plugins()
    assert _record("raiser").status == plugins.FAILED
    assert "KeyError" in _record("raiser").reason
    hook = _record("hookraiser")
    assert hook.status == plugins.FAILED
    assert "llmhal_register_ops" in hook.reason and "no_such_op" in hook.reason
