"""The quantization method registry: decorator registration, replacement, errors, lazy listing."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from llmhal.quantization import base, registry
from llmhal.quantization.registry import (
    get_quantization_config,
    list_quantization_methods,
    register_quantization_config,
)

MINE = {
    "fp8": "Fp8Config",
    "compressed-tensors": "CompressedTensorsConfig",
    "gptq": "GPTQConfig",
    "awq": "AWQConfig",
    "bitsandbytes": "BitsAndBytesConfig",
}


@pytest.fixture(autouse=True)
def clean_registry():
    registry._clear_registrations_for_tests()
    yield
    registry._clear_registrations_for_tests()


def _config_class(num_bits_default: int = 8) -> type:
    class CustomQuantConfig(base.QuantizationConfig):
        def __init__(self, num_bits: int) -> None:
            super().__init__()
            self.num_bits = num_bits

        @classmethod
        def get_name(cls) -> str:
            return "custom_quant"

        @classmethod
        def get_supported_act_dtypes(cls) -> list[torch.dtype]:
            return [torch.float16, torch.bfloat16]

        @classmethod
        def from_config(cls, config):
            return cls(config.get("num_bits", num_bits_default))

        def get_quant_method(self, layer, prefix):
            return None

    return CustomQuantConfig


def test_decorator_registers_and_lookup_returns_the_class():
    cls = register_quantization_config("custom_quant")(_config_class())
    assert get_quantization_config("custom_quant") is cls
    assert cls.from_config({}).num_bits == 8
    entry = next(e for e in list_quantization_methods() if e.name == "custom_quant")
    assert entry.provider == "registered" and entry.class_path.endswith("CustomQuantConfig")


def test_a_class_that_is_not_a_quantization_config_is_rejected():
    class NotAConfig:
        pass

    with pytest.raises(TypeError, match=r"must subclass llmhal\.quantization\.QuantizationConfig"):
        register_quantization_config("bogus")(NotAConfig)
    assert "bogus" not in {e.name for e in list_quantization_methods()}


def test_re_registering_warns_and_replaces(caplog):
    first = register_quantization_config("custom_quant")(_config_class(4))
    second = _config_class(2)
    logger = logging.getLogger("llmhal")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="llmhal"):
            register_quantization_config("custom_quant")(second)
    finally:
        logger.removeHandler(caplog.handler)
    assert "'custom_quant' already exists" in caplog.text
    assert get_quantization_config("custom_quant") is second is not first


def test_unknown_name_lists_the_registered_methods():
    register_quantization_config("custom_quant")(_config_class())
    with pytest.raises(ValueError, match="Unknown quantization method 'nope'") as err:
        get_quantization_config("nope")
    for name in [*MINE, "custom_quant"]:
        assert name in str(err.value)


@pytest.mark.parametrize("name", list(MINE))
def test_core_methods_resolve_to_their_config_classes(name):
    cls = get_quantization_config(name)
    assert issubclass(cls, base.QuantizationConfig)
    assert cls.__name__ == MINE[name] and cls.get_name() == name


def test_listing_imports_no_method_module():
    code = textwrap.dedent(
        """
        import sys
        from llmhal.quantization.registry import list_quantization_methods
        names = {e.name for e in list_quantization_methods()}
        assert {"fp8", "gptq", "awq", "compressed-tensors", "bitsandbytes"} <= names, names
        loaded = sorted(m for m in sys.modules if m.startswith("llmhal.quantization."))
        print("LOADED", loaded)
        print("HEAVY", [m for m in ("bitsandbytes", "compressed_tensors") if m in sys.modules])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    loaded, heavy = out.split("LOADED", 1)[1].split("HEAVY", 1)
    for module in ("fp8", "gptq", "awq", "compressed_tensors", "bitsandbytes", "gguf"):
        assert f"llmhal.quantization.{module}'" not in loaded, loaded
    assert heavy.strip() == "[]"


def test_kv_cache_scale_names_map_onto_the_attention_buffers():
    from llmhal.quantization.module_names import kv_cache_scale_name

    assert kv_cache_scale_name("model.layers.3.self_attn.k_proj.output_scale") == (
        "model.layers.3.self_attn.attn.k_scale"
    )
    assert kv_cache_scale_name("model.layers.3.self_attn.v_scale") == (
        "model.layers.3.self_attn.attn.v_scale"
    )
    assert kv_cache_scale_name("model.layers.3.self_attn.attn.k_scale") is None
    assert kv_cache_scale_name("model.layers.3.self_attn.k_proj.weight_scale") is None
