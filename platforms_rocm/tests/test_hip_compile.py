"""rocm_attn's Triton kernels compile for real AMD architectures, on this CPU.

Triton's HIP backend runs without a GPU, so each arch's compiler decides here what it would decide
at the first decode step on the device (an ``input_precision`` only gfx942 accepts failed on every
other arch). The launches are the ones :func:`decode_launches` builds for real tensors, so the
argument types and constants are those a step would use.
"""

from __future__ import annotations

import pytest
import torch

from llmhal_rocm.attention import paged_decode
from llmhal_rocm.attention.aot import CHECKED_ARCHS, compile_paged_decode, example_launches


@pytest.fixture(autouse=True)
def _fresh_triton_cache(tmp_path, monkeypatch):
    # A cached binary would hide what the compiler says today.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    if paged_decode.interpreter_active():
        pytest.skip("the kernels were imported under TRITON_INTERPRET=1 and cannot be compiled")


def _assert_compiled(kernels) -> None:
    assert [k.name for k in kernels] == ["_decode_split_kernel", "_merge_kernel"]
    for k in kernels:
        assert k.asm["hsaco"] and ".amdgcn_target" in k.asm["amdgcn"]


def test_decode_kernels_compile_for_cdna2_in_bf16():
    # gfx90a (MI200) refused the kernel's tf32 dot precision: only gfx942 accepts tf32.
    kernels = compile_paged_decode("gfx90a", torch.bfloat16)
    _assert_compiled(kernels)
    assert "gfx90a" in kernels[0].asm["amdgcn"]


def test_launches_use_the_step_tensors_types():
    split, merge = example_launches(torch.float16, kv_dtype=torch.float8_e4m3fnuz)
    assert split.args["q_ptr"].dtype == torch.float16
    assert split.args["k_ptr"].dtype == torch.float8_e4m3fnuz
    assert split.constexprs["DEQUANT"] is True and split.constexprs["USE_SOFT_CAP"] is True
    assert merge.args["out_ptr"].dtype == torch.float16


@pytest.mark.slow
@pytest.mark.parametrize("arch", CHECKED_ARCHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_decode_kernels_compile_for_every_checked_arch(arch, dtype):
    _assert_compiled(compile_paged_decode(arch, dtype))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "kv_dtype"),
    [
        ("gfx942", torch.float8_e4m3fnuz),
        ("gfx950", torch.float8_e4m3fn),
        ("gfx90a", torch.float8_e5m2),
    ],
    ids=str,
)
def test_decode_kernels_compile_with_fp8_caches(arch, kv_dtype):
    _assert_compiled(compile_paged_decode(arch, torch.bfloat16, kv_dtype=kv_dtype))


@pytest.mark.slow
def test_decode_kernels_compile_for_hopper():
    # The kernel also runs on NVIDIA GPUs (ci/gpu-check checks its numerics on an H200).
    kernels = compile_paged_decode("sm_90", torch.bfloat16)
    assert [k.name for k in kernels] == ["_decode_split_kernel", "_merge_kernel"]
    assert all(k.asm["cubin"] for k in kernels)
