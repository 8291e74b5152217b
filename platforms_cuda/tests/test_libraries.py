"""Installs that are found but broken: each must be an availability reason, never a backend that
looks usable and raises AttributeError (or crashes) on its first forward.

Each case lays out on disk what the real broken install leaves (a namespace package, a library that
fails to load, a distribution's metadata) and puts the folder on ``sys.path``.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from llmhal_cuda import libraries
from llmhal_cuda.attention.flash_attn import FlashAttentionBackend, flash_attn_version
from llmhal_cuda.attention.flashinfer import FlashInferBackend
from llmhal_cuda.platform import CudaPlatform
from llmhal_cuda.quantization.fbgemm_fp8 import fbgemm_rowwise_available

MODULES = ("flash_attn", "flash_attn_interface", "flashinfer", "fbgemm_gpu")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``site({"pkg/__init__.py": text, ...})``: write the files and put the folder first on
    sys.path; the GPU libraries' import names start out unimported."""
    for name in MODULES:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, loaded)
    libraries.fbgemm_genai_reason.cache_clear()
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(files: dict[str, str]) -> Path:
        for rel, text in files.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text))
        return tmp_path

    yield write
    libraries.fbgemm_genai_reason.cache_clear()


@pytest.fixture
def h100(fake_inventory, gpus) -> CudaPlatform:
    return CudaPlatform(fake_inventory(gpus.H100))


def test_flash_attn_4_namespace_is_not_flash_attention_2(site, h100):
    # flash-attn-4 installs flash_attn/cute with no flash_attn/__init__.py.
    site({"flash_attn/cute/__init__.py": "def flash_attn_func(*a, **k): ...\n"})
    (reason,) = FlashAttentionBackend.availability(h100)
    assert "flash_attn (a namespace package at" in reason
    assert "has no flash_attn_varlen_func" in reason and "flash-attn-4" in reason
    assert flash_attn_version((9, 0)) is None


def test_flash_attn_built_for_another_torch(site, h100):
    site({"flash_attn/__init__.py": """
        raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")
        """})  # fmt: skip
    (reason,) = FlashAttentionBackend.availability(h100)
    assert reason.startswith("flash_attn is installed but cannot be imported (ImportError: ")
    assert "undefined symbol" in reason and "reinstall llmhal-cuda[flash-attn]" in reason


def test_a_working_flash_attn_2_is_available(site, h100):
    site({"flash_attn/__init__.py": "def flash_attn_varlen_func(*a, **k): ...\n"})
    assert FlashAttentionBackend.availability(h100) == []
    assert flash_attn_version((8, 0)) == 2


def test_flashinfer_without_the_paged_wrappers(site, h100):
    site({"flashinfer/__init__.py": "__version__ = '0.0.1'\n"})
    (reason,) = FlashInferBackend.availability(h100)
    assert "has no BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper" in (
        reason
    )


def _dist(name: str, version: str) -> dict[str, str]:
    folder = f"{name.replace('-', '_')}-{version}.dist-info"
    return {
        f"{folder}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{folder}/top_level.txt": "fbgemm_gpu\n",
    }


def _paired_fbgemm_version() -> str:
    have = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    paired = {t: f for f, t in libraries.FBGEMM_TORCH.items()}
    if have not in paired:
        pytest.skip(f"no FBGEMM release is paired with torch {have} in the table")
    return paired[have] + ".0"


def test_fbgemm_built_for_another_torch_is_not_imported(site):
    have = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    other = next(f for f, t in libraries.FBGEMM_TORCH.items() if t != have)
    # Importing a library built for another torch can crash: the check must not import it.
    site({
        **_dist("fbgemm-gpu-genai", other + ".0"),
        "fbgemm_gpu/__init__.py": "raise SystemExit('imported a mismatched FBGEMM')\n",
    })  # fmt: skip
    reason = libraries.fbgemm_genai_reason()
    assert reason is not None and reason.startswith(
        f"fbgemm-gpu-genai {other}.0 is built for torch"
    )
    assert f"this is torch {torch.__version__}" in reason
    assert not fbgemm_rowwise_available()


def test_fbgemm_without_genai_ops(site):
    version = _paired_fbgemm_version()
    site({**_dist("fbgemm-gpu", version), "fbgemm_gpu/__init__.py": ""})
    reason = libraries.fbgemm_genai_reason()
    assert reason is not None
    assert reason.startswith(f"fbgemm-gpu {version} has no usable GenAI ops")
    assert "pip install fbgemm-gpu-genai" in reason


def test_fbgemm_genai_that_registers_the_ops(site, monkeypatch):
    version = _paired_fbgemm_version()
    site({
        **_dist("fbgemm-gpu-genai", version),
        "fbgemm_gpu/__init__.py": "",
        "fbgemm_gpu/experimental/__init__.py": "",
        "fbgemm_gpu/experimental/gen_ai/__init__.py": "",
    })  # fmt: skip
    assert "registers no torch.ops.fbgemm.quantize_fp8_per_row" in libraries.fbgemm_genai_reason()
    ops = type("Ops", (), {"quantize_fp8_per_row": 1, "f8f8bf16_rowwise": 1})()
    monkeypatch.setattr(torch.ops, "fbgemm", ops, raising=False)
    libraries.fbgemm_genai_reason.cache_clear()
    assert libraries.fbgemm_genai_reason() is None


def test_doctor_shows_why(site, h100):
    from llmhal import doctor
    from llmhal.testing.isolation import switched_platform

    site({"flash_attn/cute/__init__.py": "", "flashinfer/__init__.py": ""})
    with switched_platform() as use:
        use(h100)
        report = doctor.collect()
    rows = {b["name"]: b for b in report["attention_backends"]}
    assert not rows["flash_attn"]["available"]
    assert any("flash-attn-4" in r for r in rows["flash_attn"]["reasons"])
    assert any(
        "has no BatchDecodeWithPagedKVCacheWrapper" in r for r in rows["flashinfer"]["reasons"]
    )
    assert "flash-attn-4" in doctor.format_report(report)


def test_signature_drift_finds_what_breaks_llmhal_calls():
    from llmhal.testing.signatures import signature_drift
    from llmhal_cuda import upstream_api

    ours = upstream_api.flash_attn_varlen_func
    assert signature_drift(ours, ours) == []

    def renamed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                softmax_scale=None, causal=False, window_size=(-1, -1), logits_soft_cap=0.0,
                alibi_slopes=None, deterministic=False, return_attn_probs=False,
                block_table=None): ...  # fmt: skip

    def reordered(q, k, v, cu_seqlens_k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, **kwargs): ...

    assert signature_drift(ours, renamed) == ["no parameter 'softcap'"]
    assert signature_drift(ours, reordered) == [
        "'cu_seqlens_q' is positional 4, expected 3",
        "'cu_seqlens_k' is positional 3, expected 4",
    ]


def test_the_platform_description_lists_each_library(site, h100):
    site({"flash_attn/cute/__init__.py": ""})
    libs = h100.describe()["libraries"]
    assert "flash-attn-4" in libs["flash_attn (flash_attn backend, FA2)"]
    assert libs["fbgemm_gpu (fbgemm_fp8's rowwise GEMM)"] == (
        "fbgemm_gpu is not installed (pip install fbgemm-gpu-genai)"
    )
