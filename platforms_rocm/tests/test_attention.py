"""rocm_attn and rocm_aiter_fa on this CPU machine.

* The split-KV decode kernel and ``rocm_attn`` run for real, in Triton's interpreter
  (``TRITON_INTERPRET=1``, in a fresh subprocess: Triton reads the variable at kernel definition).
* aiter needs an MI300/MI350, so its glue is checked through a pure-torch stand-in that follows
  ``aiter.flash_attn_varlen_func``'s documented contract (bottom-right causal mask, ``window_size``,
  ``logits_soft_cap``); the conformance suite compares against core's reference backend.
"""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import types
from collections.abc import Iterator

import pytest
import torch

from llmhal.attention import selector
from llmhal.attention.backend import AttentionRequirements
from llmhal.attention.batch import build_common_metadata
from llmhal.attention.selector import AttentionBackendError, select_attention_backend
from llmhal.platforms import UnspecifiedPlatform
from llmhal.testing.attention_conformance import (
    check_attention_case,
    conformance_cases,
    run_attention_case,
)
from llmhal.testing.isolation import switched_platform
from llmhal.testing.signatures import bound_to
from llmhal_rocm import upstream_api
from llmhal_rocm.attention.rocm_aiter_fa import AiterFlashAttentionBackend, AiterFlashAttentionImpl
from llmhal_rocm.attention.rocm_attn import RocmAttentionBackend, _sub_step
from llmhal_rocm.platform import RocmPlatform

KERNEL_MODULE = "llmhal_rocm.attention.paged_decode"
CORE_KERNEL_MODULE = "llmhal.attention.triton_kernels"  # rocm_attn's prefill path


_SUBPROCESS_FLAG = "LLMHAL_ROCM_TRITON_SUBPROCESS"


@pytest.fixture
def triton_device() -> str:
    """The device Triton kernels run on here: a GPU, else the CPU through the interpreter.

    Triton decides between compiling and interpreting when a kernel is decorated, i.e. when a
    kernel module is first imported, so the interpreter runs only in a fresh process started with
    ``TRITON_INTERPRET=1`` (see :func:`test_triton_kernels_in_the_interpreter`); reloading modules
    in this process would leave other modules holding the old kernels.
    """
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get(_SUBPROCESS_FLAG) != "1" or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "runs in the Triton-interpreter subprocess (test_triton_kernels_in_the_interpreter)"
        )
    return "cpu"


def test_triton_kernels_in_the_interpreter(request: pytest.FixtureRequest) -> None:
    """Run this file's kernel tests in a fresh process with ``TRITON_INTERPRET=1``."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() or os.environ.get(_SUBPROCESS_FLAG) == "1":
        pytest.skip("kernels run directly here")
    markexpr = request.config.getoption("-m") or ""
    env = dict(os.environ, TRITON_INTERPRET="1", **{_SUBPROCESS_FLAG: "1"})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
           "-k", "paged_decode_kernel or rocm_attn_matches_reference", "-m", markexpr]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout


@pytest.fixture
def rocm(rocm_env, gpus, fake_inventory) -> Iterator:
    """``rocm(model)``: a fake RocmPlatform on that GPU, made the current platform."""
    with switched_platform() as use:
        yield lambda model: use(RocmPlatform(fake_inventory(getattr(gpus, model))))


# ----------------------------------------------------------------------- split-KV decode kernel
def _decode_reference(q, kv, tables, seq, bs, window=None, cap=None, k_scale=1.0, v_scale=1.0):
    out = []
    h, kvh = q.shape[1], kv.shape[3]
    for i, n in enumerate(seq):
        slots = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(n)])
        k = kv[0].reshape(-1, kvh, kv.shape[-1])[slots].float().repeat_interleave(h // kvh, 1)
        v = kv[1].reshape(-1, kvh, kv.shape[-1])[slots].float().repeat_interleave(h // kvh, 1)
        s = torch.einsum("hd,khd->hk", q[i].float(), k * k_scale) * q.shape[-1] ** -0.5
        if cap:
            s = cap * torch.tanh(s / cap)
        if window:
            s[:, torch.arange(n) <= n - 1 - window] = float("-inf")
        out.append(torch.einsum("hk,khd->hd", s.softmax(-1), v * v_scale))
    return torch.stack(out).to(q.dtype)


@pytest.mark.parametrize(
    ("window", "cap", "pages_per_split", "dtype", "block_size", "head_size", "heads", "fp8"),
    [
        (None, None, 16, torch.float32, 16, 64, (4, 2), False),  # one split per request
        (None, None, 1, torch.float32, 16, 80, (8, 1), False),  # many splits, odd head size, MQA
        (13, 1.5, 1, torch.bfloat16, 32, 64, (4, 4), False),  # window skips splits; soft-cap
        (None, None, 2, torch.float32, 16, 64, (4, 2), True),  # fp8 cache with scales
    ],
)
def test_paged_decode_kernel(
    triton_device, window, cap, pages_per_split, dtype, block_size, head_size, heads, fp8
):
    from llmhal_rocm.attention.paged_decode import paged_decode

    gen = torch.Generator().manual_seed(0)
    seq, (h, kvh) = [19, 50, 7, 1], heads
    need = [-(-n // block_size) for n in seq]
    perm = torch.randperm(sum(need) + 2, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    kv = torch.randn(2, len(perm), block_size, kvh, head_size, generator=gen).to(dtype)
    table = torch.zeros(len(seq), max(need), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    q = torch.randn(len(seq), h, head_size, generator=gen).to(dtype)
    ks, vs = (0.05, 0.03) if fp8 else (1.0, 1.0)
    if fp8:
        kv = torch.stack([(kv[0] / ks), (kv[1] / vs)]).to(torch.float8_e4m3fn)
    dev = torch.device(triton_device)
    out = paged_decode(
        q.to(dev), kv.to(dev), table.to(dev), torch.tensor(seq, dtype=torch.int32, device=dev),
        max(seq), head_size**-0.5, torch.tensor(ks, device=dev), torch.tensor(vs, device=dev),
        sliding_window=window, logits_soft_cap=cap, pages_per_split=pages_per_split,
    )  # fmt: skip
    ref = _decode_reference(q, kv, tables, seq, block_size, window, cap, ks, vs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)


def test_sub_step_rebases_a_prefill_part():
    common = build_common_metadata(
        [1, 1, 5, 3], [16, 40, 30, 0], [[4, 0], [9, 1, 2], [3, 8, 5], [6]], 16
    )
    part = _sub_step(common, 2, 4)
    whole = build_common_metadata([5, 3], [30, 0], [[3, 8, 5], [6]], 16)
    for field in (
        "query_start_loc",
        "seq_lens",
        "slot_mapping",
        "positions",
        "num_computed_tokens_cpu",
    ):
        assert getattr(part, field).tolist() == getattr(whole, field).tolist(), field
    assert part.block_table[:, :3].tolist() == [[3, 8, 5], [6, 0, 0]]
    assert (part.num_reqs, part.num_actual_tokens, part.max_query_len, part.max_seq_len) == (
        2,
        8,
        5,
        35,
    )
    assert (part.num_decodes, part.num_decode_tokens) == (0, 0)


# ------------------------------------------------------------------------------- rocm_attn
@pytest.mark.parametrize(
    "case",
    [c for i, c in enumerate(conformance_cases(RocmAttentionBackend)) if i in (1, 4)],
    ids=lambda c: c.id,
)
def test_rocm_attn_matches_reference(triton_device, rocm, case):
    platform = rocm("MI300X")
    check_attention_case(RocmAttentionBackend, case, device=triton_device, platform=platform)


@pytest.mark.slow
@pytest.mark.parametrize("case", conformance_cases(RocmAttentionBackend), ids=lambda c: c.id)
def test_rocm_attn_matches_reference_all_quick_cases(triton_device, rocm, case):
    platform = rocm("MI300X")
    check_attention_case(RocmAttentionBackend, case, device=triton_device, platform=platform)


def _platform_on(arch: str) -> RocmPlatform:
    from llmhal_rocm.arch import arch_capability
    from llmhal_rocm.detect import RocmDevice, RocmInventory

    device = RocmDevice(0, "AMD GPU", "", arch, arch_capability(arch), 16 << 30)
    return RocmPlatform(RocmInventory((device,)))


def test_rocm_attn_availability(rocm_env, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    supported = RocmAttentionBackend.availability(_platform_on("gfx90a"))
    assert not [r for r in supported if "Triton does not support" in r]
    reasons = RocmAttentionBackend.availability(_platform_on("gfx906"))
    assert any("Triton does not support this GPU (gfx906" in r for r in reasons)
    assert RocmAttentionBackend.availability(UnspecifiedPlatform()) == [
        "needs the rocm platform (this is the unspecified platform)"
    ]


# --------------------------------------------------------------------------- rocm_aiter_fa
def _attend(q, k, v, scale, window, softcap):
    sq, sk = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(g, 1) for t in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None] + (sk - sq)  # bottom-right aligned causal mask
    j = torch.arange(sk)[None, :]
    ok = (j <= i) & ((j >= i - window[0]) if window[0] >= 0 else True)
    p = s.masked_fill(~ok, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)


def fake_aiter() -> types.ModuleType:
    m = types.ModuleType("aiter")
    m.__spec__ = importlib.machinery.ModuleSpec("aiter", None)

    @bound_to(upstream_api.flash_attn_varlen_func)
    def flash_attn_varlen_func(a):
        q, k, v, cu_q, cu_k = (a[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"))
        # aiter's varlen preconditions (as flash-attention's): int32 contiguous cumulative
        # lengths, contiguous last dimensions, fp16/bf16.
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            if a[name].dtype != torch.int32 or not a[name].is_contiguous():
                raise RuntimeError(f"{name} must be a contiguous int32 tensor")
        if any(t.stride(-1) != 1 for t in (q, k, v)):
            raise RuntimeError("Input tensor must have contiguous last dimension")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("aiter's flash attention takes fp16 and bf16 only")
        # Inference: no dropout, causal, the 8th positional is min_seqlen_q here.
        assert a["causal"] and a["dropout_p"] == 0.0 and a["min_seqlen_q"] == 0
        assert k.shape[0] == int(cu_k[-1])
        out = torch.empty_like(q)
        for r in range(cu_q.numel() - 1):
            qs, qe, ks, ke = (int(x) for x in (cu_q[r], cu_q[r + 1], cu_k[r], cu_k[r + 1]))
            out[qs:qe] = _attend(
                q[qs:qe], k[ks:ke], v[ks:ke], a["softmax_scale"], a["window_size"],
                a["logits_soft_cap"],
            )  # fmt: skip
        return out

    m.flash_attn_varlen_func = flash_attn_varlen_func
    return m


@pytest.fixture
def aiter(monkeypatch):
    def install(present: bool) -> None:
        monkeypatch.setitem(sys.modules, "aiter", fake_aiter() if present else None)

    install(False)
    return install


@pytest.mark.parametrize("case", conformance_cases(AiterFlashAttentionBackend), ids=lambda c: c.id)
def test_aiter_glue_matches_reference(rocm, aiter, case):
    platform = rocm("MI300X")
    aiter(True)
    result = run_attention_case(AiterFlashAttentionBackend, case, platform=platform)
    if result.skipped:
        assert case.kv_cache_dtype != "auto", result.skipped  # only fp8 cases are refused
        return
    assert result.failures == ()


def test_aiter_availability_reasons(rocm, aiter):
    req = AttentionRequirements(64, 8, 2, torch.bfloat16)
    assert AiterFlashAttentionBackend.availability(rocm("MI300X")) == [
        "aiter is not installed (pip install llmhal-rocm[aiter])"
    ]
    aiter(True)
    assert AiterFlashAttentionBackend.validate(req, rocm("MI355X")) == []
    assert AiterFlashAttentionBackend.availability(rocm("MI250X")) == [
        "aiter flash attention needs gfx942 or gfx950 (this device: gfx90a)"
    ]
    with pytest.raises(ValueError, match="needs the rocm_attn backend"):
        AiterFlashAttentionImpl(8, 64, 0.125, 2, kv_cache_dtype="fp8_e4m3")


def test_aiter_selection_is_opt_in(rocm, aiter, monkeypatch):
    rocm("MI300X")
    aiter(True)
    req = AttentionRequirements(64, 8, 2, torch.bfloat16)
    assert select_attention_backend(req).name == "rocm_attn"
    selector._clear_cache_for_tests()
    monkeypatch.setenv("VLLM_ROCM_USE_AITER", "1")
    assert select_attention_backend(req).name == "rocm_aiter_fa"
    selector._clear_cache_for_tests()
    monkeypatch.delenv("VLLM_ROCM_USE_AITER")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "rocm_aiter_fa")  # explicit choice: honoured
    assert select_attention_backend(req).name == "rocm_aiter_fa"


def test_aiter_explicit_choice_on_an_unsupported_arch(rocm, aiter, monkeypatch):
    rocm("RX7900")
    aiter(True)
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "rocm_aiter_fa")
    with pytest.raises(AttentionBackendError) as err:
        select_attention_backend(AttentionRequirements(64, 8, 2, torch.bfloat16))
    msg = str(err.value)
    assert "on the rocm platform" in msg and "this device: gfx1100" in msg
    assert "Backends that work here:" in msg


def test_pypi_aiter_is_not_amd_aiter(rocm, monkeypatch, tmp_path):
    """PyPI's 'aiter' (asynchronous iterators) owns the same import name as AMD's kernels."""
    monkeypatch.delitem(sys.modules, "aiter", raising=False)
    (tmp_path / "aiter").mkdir()
    (tmp_path / "aiter" / "__init__.py").write_text("async def aiter_chain(*its): ...\n")
    dist = tmp_path / "aiter-0.13.20191203.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: aiter\nVersion: 0.13.20191203\n")
    (dist / "top_level.txt").write_text("aiter\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (reason,) = AiterFlashAttentionBackend.availability(rocm("MI300X"))
    assert "has no flash_attn_varlen_func" in reason
    assert "'aiter' here comes from aiter" in reason
    assert reason.endswith("pip uninstall aiter && pip install amd-aiter")


def test_the_aiter_stand_in_refuses_what_aiter_refuses():
    fa = fake_aiter().flash_attn_varlen_func
    q = torch.randn(3, 4, 64, dtype=torch.bfloat16)
    kv = torch.randn(3, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    assert fa(q, kv, kv, cu, cu, 3, 3, softmax_scale=0.125, causal=True).shape == q.shape
    with pytest.raises(AssertionError):  # a positional 8th argument is min_seqlen_q in aiter
        fa(q, kv, kv, cu, cu, 3, 3, 0.0, 0.125, causal=True)
    with pytest.raises(TypeError, match="'softcap'"):  # flash-attention's name, not aiter's
        fa(q, kv, kv, cu, cu, 3, 3, causal=True, softcap=30.0)
    with pytest.raises(RuntimeError, match="int32"):
        fa(q, kv, kv, cu.long(), cu, 3, 3, causal=True)
