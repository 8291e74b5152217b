"""Where recurrent layers keep their states: vLLM's ``mamba_cache_dtype`` (conv and SSM states,
and linear attention's) and ``mamba_ssm_cache_dtype`` (the SSM state alone), "auto" = the model's
dtype, as transformers keeps them. A bfloat16 model keeps a bfloat16 SSM state by default and
matches transformers' bfloat16 model; ``mamba_ssm_cache_dtype="float32"`` keeps it in float32.
"""

from __future__ import annotations

import copy

import pytest
import torch

from llmhal import LLM
from llmhal.attention.state import mamba_state_dtypes, recurrent_layers
from llmhal.testing.engine_parity import PROMPTS, compare_with_references, hf_references

BF = torch.bfloat16
KW = dict(max_num_seqs=4, max_num_batched_tokens=8)


def _specs(llm) -> dict[str, torch.dtype]:
    layers = recurrent_layers(llm.engine.runner.model)
    return {spec.name: spec.dtype for m in layers for spec in m.state_specs()}


def test_dtypes_follow_vllm_rules():
    f32, f16 = torch.float32, torch.float16
    assert mamba_state_dtypes(BF) == (BF, BF)
    assert mamba_state_dtypes(BF, "auto", "float32") == (BF, f32)
    assert mamba_state_dtypes(BF, "float32") == (f32, f32)
    assert mamba_state_dtypes(f32, "auto", "bfloat16") == (f32, BF)
    assert mamba_state_dtypes(f32, "float16", "auto") == (f16, f16)


@pytest.mark.parametrize("arch", ["mamba", "mamba2", "bamba"])
def test_bfloat16_state_matches_transformers_bfloat16(tiny_models, arch):
    """The default (state in the model's dtype) against transformers' bf16 model (Mamba-1, Mamba-2,
    the Bamba hybrid), which keeps its cache in bf16 too: 12 greedy steps of prompts crossing
    chunks, prefill cut in 8-token steps."""
    folder, hf = tiny_models(arch)
    refs = hf_references(copy.deepcopy(hf).to(BF), PROMPTS, 12)
    llm = LLM(folder, dtype="bfloat16", **KW)
    assert _specs(llm) == {"conv": BF, "ssm": BF}
    # bf16 log-probabilities (a step of 2^-8 relative, ~0.016 at -4) after layers that round in
    # other places than transformers': measured up to 0.064 (bamba) and 0.042 (mamba2). With a
    # float32 SSM state the hybrid's greedy tokens leave transformers' bf16 ones within 12 steps.
    assert compare_with_references(llm, refs, atol=0.1) == []


def test_float32_ssm_state_in_a_bfloat16_model(tiny_models):
    """``mamba_ssm_cache_dtype="float32"``: the SSM state alone in float32, the same tokens as
    the default on this model, and fewer slots fit the same budget (the sizing reads the dtype)."""
    folder, hf = tiny_models("mamba2")
    refs = hf_references(copy.deepcopy(hf).to(BF), PROMPTS, 12)
    wide = LLM(folder, dtype="bfloat16", mamba_ssm_cache_dtype="float32", **KW)
    assert _specs(wide) == {"conv": BF, "ssm": torch.float32}
    assert compare_with_references(wide, refs, atol=0.1) == []
    narrow = LLM(folder, dtype="bfloat16", max_num_seqs=64)
    per_narrow = narrow.engine.runner.state_bytes_per_slot()
    per_wide = wide.engine.runner.state_bytes_per_slot()
    assert per_narrow < per_wide
    budget = 5 * per_narrow  # one budget: 5 bf16 slots, fewer float32 ones
    few = LLM(folder, dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_num_seqs=64,
              kv_cache_memory_bytes=budget)  # fmt: skip
    many = LLM(folder, dtype="bfloat16", max_num_seqs=64, kv_cache_memory_bytes=budget)
    assert many.engine.kv.num_slots == 5 > few.engine.kv.num_slots


def test_float32_model_keeps_float32_states(tiny_models):
    folder, _ = tiny_models("mamba2")
    assert _specs(LLM(folder, dtype="float32", **KW)) == {
        "conv": torch.float32,
        "ssm": torch.float32,
    }


@pytest.mark.parametrize(
    "kw,names",
    [
        (dict(mamba_ssm_cache_dtype="float16"), "float32, bfloat16"),
        (dict(mamba_cache_dtype="fp8"), "auto, float32, bfloat16, float16"),
    ],
)
def test_unserved_values_are_refused_before_loading(kw, names):
    """float16 states would run only in core's slow reference on CPU: refused naming what the
    platform serves; an unknown value names vLLM's values. Both before any model is read."""
    with pytest.raises(ValueError, match=names):
        LLM("/nonexistent/model", **kw)


def test_generate_cli_takes_the_flags(tiny_models, capsys):
    from llmhal.entrypoints import generate

    folder, _ = tiny_models("mamba2")
    argv = ["--model", folder, "--prompt", "Paris", "--max-tokens", "3", "--dtype", "bfloat16",
            "--mamba-cache-dtype", "auto", "--mamba-ssm-cache-dtype", "float32"]  # fmt: skip
    assert generate.main(argv) == 0
    assert generate.main([*argv[:-1], "float16"]) == 2
    assert "bfloat16" in capsys.readouterr().err
