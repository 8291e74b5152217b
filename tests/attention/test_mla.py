"""MLA backends (``reference_mla``, ``torch_mla``) against a float64 dense computation.

A step of two decodes, one prefill chunk after cached tokens and one fresh prefill runs through
each backend over a shuffled paged latent cache; the reference is the textbook attention with keys
and values expanded per head from the same latents. Also: the absorbed and decompressed forms agree,
the cache layout, the fp8 latent cache, and selection by kind.
"""

from __future__ import annotations

import pytest
import torch

from llmhal.attention.backend import AttentionRequirements
from llmhal.attention.mla.common import LatentKVLayout
from llmhal.attention.mla.reference import (
    ReferenceMLABackend,
    absorbed_attention,
    decompressed_attention,
)
from llmhal.attention.mla.torch_mla import TorchMLABackend
from llmhal.testing.mla_steps import DIMS, SCALE, StubLayer, run_steps


@pytest.mark.parametrize("backend", [ReferenceMLABackend, TorchMLABackend])
def test_matches_dense_attention(backend):
    out, want = run_steps(backend, StubLayer(DIMS))
    assert out.shape == (14, DIMS.num_heads, DIMS.v_head_dim)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_torch_mla_bf16_close():
    out, want = run_steps(TorchMLABackend, StubLayer(DIMS), dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert float((out.double() - want).abs().max() / want.abs().max()) < 3e-2


@pytest.mark.parametrize("backend", [ReferenceMLABackend, TorchMLABackend])
def test_fp8_latent_cache_close(backend):
    out, want = run_steps(backend, StubLayer(DIMS), cache_dtype="fp8_e4m3")
    # e4m3 keeps 3 mantissa bits: a relative error of about 2^-4 per stored latent value.
    rel = float((out.double() - want).abs().max() / want.abs().max())
    assert 0 < rel < 0.08


def test_absorbed_form_equals_decompressed_form():
    layer = StubLayer(DIMS, seed=5)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, DIMS.num_heads, DIMS.qk_head_dim, generator=g)
    latent = torch.randn(10, DIMS.latent_size, generator=g)
    mask = torch.arange(10)[None, :] <= torch.tensor([4, 8, 9])[:, None]
    a = absorbed_attention(q, latent, mask, layer, SCALE)
    b = decompressed_attention(q, latent, mask, layer, SCALE)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_latent_cache_layout():
    assert LatentKVLayout.get_kv_cache_shape(5, 16, 1, 576) == (5, 16, 576)
    with pytest.raises(ValueError, match="one KV head"):
        LatentKVLayout.get_kv_cache_shape(5, 16, 2, 576)


def _mla_requirements(**kw):
    base = dict(head_size=40, num_heads=4, num_kv_heads=1, dtype=torch.float32, kind="mla")
    return AttentionRequirements(**{**base, **kw})


def test_mla_layers_get_an_mla_backend():
    from llmhal.attention.selector import select_attention_backend

    sel = select_attention_backend(_mla_requirements())
    assert sel.backend.kind == "mla"
    assert sel.name in ("torch_mla", "reference_mla") or sel.selected_by == "priority"
    assert ReferenceMLABackend.validate(_mla_requirements(num_kv_heads=2))


def test_explicit_mha_backend_is_refused_for_mla(monkeypatch):
    from llmhal.attention.selector import AttentionBackendError, select_attention_backend

    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "reference")
    with pytest.raises(AttentionBackendError) as e:
        select_attention_backend(_mla_requirements(block_size=8))
    assert "serves mha layers, not mla" in str(e.value)
    assert "torch_mla" in str(e.value) and "reference_mla" in str(e.value)
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "REFERENCE_MLA")
    assert select_attention_backend(_mla_requirements(block_size=8)).name == "reference_mla"


# triton_mla's kernel runs in Triton's CPU interpreter, which triton reads from TRITON_INTERPRET when
# the kernel is first decorated: a subprocess, so this process's Triton kernels stay compiled ones.
_TRITON_RUNNER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import test_mla as t
from llmhal.attention.mla.triton_mla import TritonMLABackend
from llmhal.attention.mla import triton_mla_kernel as k
from triton.runtime.interpreter import InterpretedFunction
assert isinstance(k._mla_decode_kernel, InterpretedFunction), "TRITON_INTERPRET=1 not honoured"
out = {}
for cache in ("auto", "fp8_e4m3"):
    got, want = t.run_steps(TritonMLABackend, t.StubLayer(t.DIMS), cache_dtype=cache)
    out[cache] = float((got.double() - want).abs().max() / want.abs().max())
print("RESULTS" + json.dumps(out))
"""


def test_triton_mla_kernel_in_the_interpreter():
    """The Triton decode kernel (two decodes beside a prefill chunk and a fresh prefill) against
    the float64 dense computation; the fp8 latent cache within its storage error."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = str(Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_RUNNER, here],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS"))
    errors = json.loads(line.removeprefix("RESULTS"))
    assert errors["auto"] < 2e-5
    assert 0 < errors["fp8_e4m3"] < 0.08


def test_triton_mla_is_unavailable_without_a_triton_platform(monkeypatch):
    from llmhal.attention.mla.triton_mla import TritonMLABackend
    from llmhal.platforms import get_current_platform

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    platform = get_current_platform()
    if platform.capabilities.triton:
        pytest.skip("this platform runs Triton kernels")
    reasons = TritonMLABackend.availability(platform)
    assert reasons and "TRITON_INTERPRET=1" in reasons[0]
