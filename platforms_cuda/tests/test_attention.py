"""flash_attn and flashinfer on this CPU machine: registration, validation reasons, priority per
generation, error texts, and the glue to each library checked with the attention conformance suite.

The libraries need an NVIDIA GPU, so the glue tests install small pure-torch stand-ins that follow
each library's documented contract (FlashAttention's bottom-right causal mask, ``window_size``,
``softcap``, the FA2 256-multiple page rule; FlashInfer's plan/run, ``window_left``, fp8 scales). The
suite compares the backends' output, through those stand-ins, against core's reference backend, so
a wrong argument mapping (window off by one, cumulative lengths, page tables, scales) fails here.
The real libraries run in ``test_gpu.py`` (marked ``gpu``).
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from llmhal.attention import selector
from llmhal.attention.backend import AttentionRequirements
from llmhal.attention.batch import build_common_metadata
from llmhal.attention.registry import get_backend_entry
from llmhal.attention.selector import AttentionBackendError, select_attention_backend
from llmhal.platforms import UnspecifiedPlatform, get_current_platform
from llmhal.testing.attention_conformance import conformance_cases, run_attention_case
from llmhal.testing.isolation import switched_platform
from llmhal.testing.signatures import bind, bound_to
from llmhal_cuda import upstream_api
from llmhal_cuda.attention.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttnMetadataBuilder,
)
from llmhal_cuda.attention.flashinfer import FlashInferBackend, FlashInferMetadataBuilder
from llmhal_cuda.platform import CudaPlatform


# ------------------------------------------------------------------------ library stand-ins
def _module(name: str) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() sees it as installed
    return m


def _attend(q, k, v, scale, window=(-1, -1), softcap=0.0, k_scale=1.0, v_scale=1.0):
    """One sequence, FlashAttention/FlashInfer semantics: causal aligned bottom-right."""
    sq, sk = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(g, 1) * k_scale
    v = v.float().repeat_interleave(g, 1) * v_scale
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    ok = j <= i  # causal
    if window[0] >= 0:
        ok &= j >= i - window[0]
    p = s.masked_fill(~ok, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)


def _pages(cache, table_row, length):
    return cache[table_row.long()].reshape(-1, *cache.shape[2:])[:length]


def _check(ok: bool, message: str) -> None:
    """The libraries' C++ TORCH_CHECKs: a RuntimeError with their message."""
    if not ok:
        raise RuntimeError(message)


def _check_varlen(q, k, v, cu_q, cu_k, block_table=None) -> None:
    """flash-attention's mha_varlen_fwd preconditions (csrc/flash_attn/flash_api.cpp)."""
    _check(
        q.dtype in (torch.float16, torch.bfloat16),
        "FlashAttention only support fp16 and bf16 data type",
    )
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query and key must have the same dtype")
    _check(cu_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    _check(cu_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    _check(cu_q.is_contiguous() and cu_k.is_contiguous(), "cu_seqlens must be contiguous")
    for t in (q, k, v):
        _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _check(q.shape[-1] % 8 == 0 and q.shape[-1] <= 256, "unsupported head_size")
    _check(
        q.shape[1] % k.shape[-2] == 0,
        "Number of heads in key/value must divide number of heads in query",
    )
    _check(cu_q.numel() == cu_k.numel(), "cu_seqlens_q and cu_seqlens_k differ in batch size")
    if block_table is not None:
        _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
        _check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
        _check(k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256")
    else:
        _check(k.shape[0] == int(cu_k[-1]), "key has fewer rows than cu_seqlens_k[-1]")  # fmt: skip


def fake_flash_attn() -> types.ModuleType:
    m = _module("flash_attn")

    @bound_to(upstream_api.flash_attn_varlen_func)
    def flash_attn_varlen_func(a):
        q, k, v, cu_q, cu_k = (a[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"))
        block_table = a["block_table"]
        _check_varlen(q, k, v, cu_q, cu_k, block_table)
        # Inference: dropout off, causal, plain output (a positional softmax_scale would land in
        # dropout_p and be caught here).
        assert a["dropout_p"] == 0.0 and a["causal"] and not a["return_attn_probs"]
        assert isinstance(a["max_seqlen_q"], int) and isinstance(a["max_seqlen_k"], int)
        out = torch.empty_like(q)
        for r in range(cu_q.numel() - 1):
            qs, qe, ks, ke = int(cu_q[r]), int(cu_q[r + 1]), int(cu_k[r]), int(cu_k[r + 1])
            if block_table is None:
                kr, vr = k[ks:ke], v[ks:ke]
            else:
                kr, vr = _pages(k, block_table[r], ke - ks), _pages(v, block_table[r], ke - ks)
            out[qs:qe] = _attend(
                q[qs:qe], kr, vr, a["softmax_scale"], a["window_size"], a["softcap"]
            )
        return out

    m.flash_attn_varlen_func = flash_attn_varlen_func
    return m


def fake_flash_attn_interface() -> types.ModuleType:
    m = _module("flash_attn_interface")

    @bound_to(upstream_api.flash_attn_with_kvcache)
    def flash_attn_with_kvcache(a):
        q, cu_q, seqlens, table = (
            a[n] for n in ("q", "cu_seqlens_q", "cache_seqlens", "page_table")
        )
        k_cache, v_cache = a["k_cache"], a["v_cache"]
        # hopper/flash_api.cpp: int32 metadata, contiguous last dimensions.
        for name in ("cu_seqlens_q", "cache_seqlens", "page_table"):
            _check(a[name].dtype == torch.int32, f"{name} must have dtype torch.int32")
        _check(table.stride(-1) == 1, "page_table must have contiguous last dimension")
        for t in (q, k_cache, v_cache):
            _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
        assert a["causal"] and a["k"] is None and a["v"] is None  # the cache is written before
        out = torch.empty_like(q)
        for r in range(cu_q.numel() - 1):
            qs, qe, n = int(cu_q[r]), int(cu_q[r + 1]), int(seqlens[r])
            kr, vr = _pages(k_cache, table[r], n), _pages(v_cache, table[r], n)
            out[qs:qe] = _attend(
                q[qs:qe], kr, vr, a["softmax_scale"], a["window_size"], a["softcap"]
            )
        return out

    m.flash_attn_with_kvcache = flash_attn_with_kvcache
    return m


def fake_flashinfer() -> types.ModuleType:
    m = _module("flashinfer")

    class _Wrapper:
        init_signature = staticmethod(upstream_api.decode_wrapper_init)

        def __init__(self, *args, **kw):
            a = bind(self.init_signature, self, *args, **kw)
            workspace = a["float_workspace_buffer"]
            assert a["kv_layout"] == "NHD" and workspace.dtype == torch.uint8
            self.workspace = workspace
            self.planned = False

        def _plan(self, indptr, indices, last, kw):
            for t in (indptr, indices, last):
                _check(t.dtype == torch.int32, "plan's page tables must be int32")
            # Documented: the float workspace "must be initialized to 0 for its first use".
            _check(self.planned or not self.workspace.any(), "workspace is not zeroed")
            self.planned = True
            self.pages = (indptr, indices, last, kw["page_size"])
            self.kw = kw

        def _run(self, a, qo):
            q, pages = a["q"], a["paged_kv_cache"]
            kw = self.kw
            indptr, indices, last, page_size = self.pages
            assert kw["pos_encoding_mode"] == "NONE" and kw["q_data_type"] == q.dtype
            assert kw["kv_data_type"] == pages[0].dtype
            _check(q.is_contiguous(), "q must be contiguous")
            for name in ("k_scale", "v_scale"):  # Python floats: a tensor would sync per call
                assert a[name] is None or type(a[name]) is float, (name, type(a[name]))
            out = torch.empty_like(q)
            for r in range(indptr.numel() - 1):
                ids = indices[int(indptr[r]) : int(indptr[r + 1])]
                n = (ids.numel() - 1) * page_size + int(last[r])
                k, v = (c[ids.long()].reshape(-1, *c.shape[2:])[:n] for c in pages)
                qs, qe = int(qo[r]), int(qo[r + 1])
                out[qs:qe] = _attend(
                    q[qs:qe], k, v, kw["sm_scale"], (kw["window_left"], 0),
                    kw["logits_soft_cap"] or 0.0, a["k_scale"] or 1.0, a["v_scale"] or 1.0,
                )  # fmt: skip
            return out

    class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
        def plan(self, *args, **kw):
            a = bind(upstream_api.decode_plan, self, *args, **kw)
            self._plan(a["indptr"], a["indices"], a["last_page_len"], a)

        def run(self, *args, **kw):
            a = bind(upstream_api.decode_run, self, *args, **kw)
            return self._run(a, torch.arange(a["q"].shape[0] + 1))

    class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
        init_signature = staticmethod(upstream_api.prefill_wrapper_init)

        def plan(self, *args, **kw):
            a = bind(upstream_api.prefill_plan, self, *args, **kw)
            assert a["causal"]
            _check(a["qo_indptr"].dtype == torch.int32, "qo_indptr must be int32")
            self.qo = a["qo_indptr"]
            self._plan(a["paged_kv_indptr"], a["paged_kv_indices"], a["paged_kv_last_page_len"], a)

        def run(self, *args, **kw):
            return self._run(bind(upstream_api.prefill_run, self, *args, **kw), self.qo)

    m.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    m.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    return m


LIBS = {
    "flash_attn": fake_flash_attn,
    "flash_attn_interface": fake_flash_attn_interface,
    "flashinfer": fake_flashinfer,
}


@pytest.fixture
def libs(monkeypatch: pytest.MonkeyPatch):
    """``libs(*names)``: make those GPU libraries importable (as stand-ins); the others absent."""

    def install(*names: str) -> None:
        for name, make in LIBS.items():
            monkeypatch.setitem(sys.modules, name, make() if name in names else None)

    install()
    return install


@pytest.fixture
def cuda_platform(cuda_env, gpus, fake_inventory) -> Iterator:
    """``cuda_platform(model)``: make a fake CudaPlatform on that GPU the current platform."""
    with switched_platform() as use:
        yield lambda model: use(CudaPlatform(fake_inventory(getattr(gpus, model))))


def _req(dtype=torch.bfloat16, head_size=64, block_size=16, **kw) -> AttentionRequirements:
    return AttentionRequirements(head_size, 8, 2, dtype, block_size=block_size, **kw)


# ------------------------------------------------------------------------------- selection
def test_flash_attn_on_the_cpu_platform_names_platform_reason_and_alternatives(
    cuda_env, monkeypatch
):
    if get_current_platform().name != "cpu":
        pytest.skip("checks the message on the cpu platform; another platform is active here")
    selector._clear_cache_for_tests()
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "flash_attn")
    with pytest.raises(AttentionBackendError) as err:
        select_attention_backend(_req())
    msg = str(err.value)
    assert "on the cpu platform" in msg
    assert "provided by the cuda platform, which is not active here" in msg
    assert "Backends that work here:" in msg and "cpu_attn" in msg
    selector._clear_cache_for_tests()


def test_backends_are_registered_under_the_cuda_platform():
    for name in ("flash_attn", "FLASHINFER"):
        entry = get_backend_entry(name)
        assert entry is not None and entry.provider == "cuda"


def test_missing_libraries_are_reasons_that_name_the_extra(cuda_platform, libs, monkeypatch):
    cuda_platform("H100")
    sel = select_attention_backend(_req())
    rejected = dict(sel.rejected)
    assert rejected["flash_attn"] == (
        "flash_attn is not installed (pip install llmhal-cuda[flash-attn])",
    )
    assert rejected["flashinfer"] == (
        "flashinfer is not installed (pip install llmhal-cuda[flashinfer])",
    )
    assert sel.name not in ("flash_attn", "flashinfer")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASH_ATTN")
    with pytest.raises(AttentionBackendError) as err:
        select_attention_backend(_req())
    msg = str(err.value)
    assert "cannot be used on the cuda platform" in msg
    assert "pip install llmhal-cuda[flash-attn]" in msg
    assert "Backends that work here:" in msg


@pytest.mark.parametrize(("model", "expected"), [("H100", "flash_attn"), ("B200", "flashinfer")])
def test_priority_by_generation_when_both_are_installed(cuda_platform, libs, model, expected):
    cuda_platform(model)
    libs("flash_attn", "flashinfer")
    assert select_attention_backend(_req()).name == expected


def test_fp32_models_fall_past_flash_attn_and_flashinfer(cuda_platform, libs):
    cuda_platform("H100")
    libs("flash_attn", "flashinfer")
    sel = select_attention_backend(_req(torch.float32))
    rejected = dict(sel.rejected)
    assert sel.name not in ("flash_attn", "flashinfer")
    assert any("dtype float32 not supported" in r for r in rejected["flash_attn"])
    assert any("dtype float32 not supported" in r for r in rejected["flashinfer"])


def test_validation_reasons(cuda_platform, libs):
    platform = cuda_platform("A100")
    libs("flash_attn")
    ok = _req(device_capability=(8, 0))
    assert FlashAttentionBackend.validate(ok, platform) == []
    assert FlashAttentionBackend.validate(replace(ok, head_size=72), platform) == []
    assert (
        "head_size 100 not supported"
        in FlashAttentionBackend.validate(replace(ok, head_size=100), platform)[0]
    )
    assert (
        "block_size 8 not supported"
        in FlashAttentionBackend.validate(replace(ok, block_size=8), platform)[0]
    )
    assert (
        "kv_cache_dtype fp8_e4m3 not supported"
        in FlashAttentionBackend.validate(replace(ok, kv_cache_dtype="fp8_e4m3"), platform)[0]
    )
    turing = replace(ok, dtype=torch.float16, device_capability=(7, 5))
    assert FlashAttentionBackend.validate(turing, platform) == [
        "needs device capability >= 8.0 (this device: 7.5)"
    ]
    libs("flashinfer")
    assert FlashInferBackend.validate(turing, platform) == []
    assert (
        "head_size 80 not supported"
        in FlashInferBackend.validate(replace(turing, head_size=80), platform)[0]
    )
    assert FlashInferBackend.validate(replace(turing, kv_cache_dtype="fp8_e5m2"), platform) == []


def test_fa3_alone_needs_hopper(cuda_platform, libs):
    platform = cuda_platform("A100")
    libs("flash_attn_interface")
    reasons = FlashAttentionBackend.validate(_req(device_capability=(8, 0)), platform)
    assert reasons and "FlashAttention 3" in reasons[0] and "9.x" in reasons[0]
    assert FlashAttentionBackend.validate(_req(device_capability=(9, 0)), platform) == []


def test_backends_refuse_other_platforms(libs):
    libs("flash_attn", "flashinfer")
    for backend in (FlashAttentionBackend, FlashInferBackend):
        assert backend.availability(UnspecifiedPlatform()) == [
            "needs the cuda platform (this is the unspecified platform)"
        ]


# ------------------------------------------------------------------------ metadata details
@pytest.mark.parametrize(
    ("cap", "installed", "block", "version", "gather"),
    [
        ((8, 0), ("flash_attn",), 16, 2, True),
        ((8, 0), ("flash_attn",), 256, 2, False),
        ((9, 0), ("flash_attn", "flash_attn_interface"), 16, 3, False),
        ((12, 0), ("flash_attn", "flash_attn_interface"), 32, 2, True),
    ],
)
def test_flash_attn_variant_and_paging(libs, cap, installed, block, version, gather):
    libs(*installed)
    b = FlashAttnMetadataBuilder(_req(block_size=block, device_capability=cap), torch.device("cpu"))
    assert (b.version, b.gather) == (version, gather)


def test_flash_attn_refuses_fp8_caches():
    with pytest.raises(ValueError, match="flashinfer supports fp8"):
        FlashAttentionImpl(8, 64, 0.125, 2, kv_cache_dtype="fp8_e4m3")


def test_flashinfer_page_tables():
    b = FlashInferMetadataBuilder(_req(), torch.device("cpu"))
    # Two decodes then a chunk continuing a context and a fresh prefill.
    common = build_common_metadata(
        [1, 1, 5, 3], [16, 40, 30, 0], [[4, 0], [9, 1, 2], [3, 8, 5], [6]], 16
    )
    m = b.build(common)
    assert m.page_indptr.tolist() == [0, 2, 5, 8, 9]
    assert m.last_page_len.tolist() == [1, 9, 3, 3]
    assert m.page_indices.tolist()[:2] == [4, 0]  # request 0 uses two pages (17 tokens)
    assert m.prefill_qo_indptr.tolist() == [0, 5, 8]
    indptr, indices, last = m._part(2, 4)
    assert indptr.tolist() == [0, 3, 4] and last.tolist() == [3, 3]


# --------------------------------------------------------------- glue numerics (stand-ins)
def _cases(backend, **kw):
    return conformance_cases(backend, **kw)


@pytest.mark.parametrize("case", _cases(FlashAttentionBackend), ids=lambda c: c.id)
@pytest.mark.parametrize(("model", "installed"), [("A100", "fa2"), ("H100", "fa3")])
def test_flash_attn_glue_matches_reference(cuda_platform, libs, case, model, installed):
    platform = cuda_platform(model)
    libs("flash_attn", "flash_attn_interface") if installed == "fa3" else libs("flash_attn")
    result = run_attention_case(FlashAttentionBackend, case, platform=platform)
    if result.skipped:
        assert case.kv_cache_dtype != "auto", result.skipped  # only fp8 cases are refused
        return
    assert result.failures == ()


@pytest.mark.parametrize("case", _cases(FlashAttentionBackend)[:2], ids=lambda c: c.id)
def test_flash_attn_fa2_paged_path_matches_reference(cuda_platform, libs, case):
    platform = cuda_platform("A100")
    libs("flash_attn")
    result = run_attention_case(
        FlashAttentionBackend, replace(case, block_size=256), platform=platform
    )
    assert not result.skipped and result.failures == ()


@pytest.mark.parametrize("case", _cases(FlashInferBackend), ids=lambda c: c.id)
def test_flashinfer_glue_matches_reference(cuda_platform, libs, case):
    platform = cuda_platform("H100")
    libs("flashinfer")
    result = run_attention_case(FlashInferBackend, case, platform=platform)
    if result.skipped:
        assert all("head_size" in r for r in result.skipped), result.skipped
        return
    assert result.failures == ()


# ------------------------------------------------------------- the stand-ins fail like the real
def _varlen_inputs():
    q = torch.randn(5, 4, 64, dtype=torch.bfloat16)
    kv = torch.randn(5, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    return q, kv, cu


def test_stand_ins_refuse_what_the_libraries_refuse():
    fa2 = fake_flash_attn().flash_attn_varlen_func
    q, kv, cu = _varlen_inputs()
    assert fa2(q, kv, kv, cu, cu, 3, 3, softmax_scale=0.125, causal=True).shape == q.shape
    with pytest.raises(RuntimeError, match="cu_seqlens_q must have dtype int32"):
        fa2(q, kv, kv, cu.long(), cu, 3, 3, softmax_scale=0.125, causal=True)
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        fa2(q.transpose(1, 2).contiguous().transpose(1, 2), kv, kv, cu, cu, 3, 3, causal=True)
    with pytest.raises(AssertionError):  # softmax_scale in 8th place is dropout_p upstream
        fa2(q, kv, kv, cu, cu, 3, 3, 0.125, causal=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'logits_soft_cap'"):
        fa2(q, kv, kv, cu, cu, 3, 3, causal=True, logits_soft_cap=30.0)  # aiter's name
    fi = fake_flashinfer()
    workspace = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(TypeError, match="unexpected keyword argument 'use_tensorcores'"):
        fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensorcores=True)
    decode = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    pages = (torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([1]))  # int64
    with pytest.raises(RuntimeError, match="int32"):
        decode.plan(*pages, 4, 2, 64, 16, pos_encoding_mode="NONE")
    with pytest.raises(TypeError, match="too many positional arguments"):
        decode.plan(*(t.int() for t in pages), 4, 2, 64, 16, "NONE")  # keyword-only upstream


def test_flashinfer_workspace_starts_zeroed(cuda_platform, libs, monkeypatch):
    """A reused allocation holds old bytes; FlashInfer needs zeros before its first plan."""
    platform = cuda_platform("H100")
    libs("flashinfer")
    real_empty = torch.empty

    def used_memory(*args, **kw):
        return (
            real_empty(*args, **kw).fill_(0xA5)
            if kw.get("dtype") == torch.uint8
            else (real_empty(*args, **kw))
        )

    monkeypatch.setattr(torch, "empty", used_memory)
    case = _cases(FlashInferBackend)[0]
    result = run_attention_case(FlashInferBackend, case, platform=platform)
    assert result.failures == () and not result.skipped


def test_flashinfer_reads_fp8_scales_from_the_device_once():
    from llmhal_cuda.attention.flashinfer import FlashInferImpl

    reads = []

    class Scale(torch.Tensor):
        def __float__(self):
            reads.append(1)
            return super().__float__()

    def scale(value: float) -> torch.Tensor:
        return torch.Tensor._make_subclass(Scale, torch.tensor(value))

    impl = FlashInferImpl(8, 64, 0.125, 2, kv_cache_dtype="fp8_e4m3")
    layer = types.SimpleNamespace(k_scale=scale(0.5), v_scale=scale(0.25))
    for _ in range(3):  # three steps
        assert impl.kv_scales(layer) == {"k_scale": 0.5, "v_scale": 0.25}
    assert len(reads) == 2
    layer.k_scale.fill_(2.0)  # rewritten in place (a reload): read again
    assert impl.kv_scales(layer)["k_scale"] == 2.0 and len(reads) == 4
