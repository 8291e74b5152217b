"""cpu_attn against the pure-torch reference (the shared conformance suite), on both of its paths:
the native paged kernel and the pure-torch fallback used when no compiler is available."""

from __future__ import annotations

import itertools

import pytest
import torch

from llmhal.attention.backend import AttentionRequirements
from llmhal.attention.batch import build_common_metadata
from llmhal.testing.attention_conformance import (
    AttentionCase,
    check_attention_case,
    conformance_cases,
    run_attention_case,
    run_attention_conformance,
)
from llmhal_cpu.attention import cpu_attn, native
from llmhal_cpu.attention.cpu_attn import CpuAttentionBackend

ALL_DTYPES = ("float32", "bfloat16", "float16")


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """Run the test once through the native kernel and once through the pure-torch paths."""
    if request.param == "torch":
        monkeypatch.setenv("LLMHAL_CPU_ATTN_KERNEL", "0")
    elif native.load_kernel() is None:
        pytest.skip(f"native kernel unavailable here: {native.kernel_status()}")
    return request.param


@pytest.fixture
def fresh_kernel_state(monkeypatch, tmp_path):
    """An empty kernel cache and a not-yet-loaded kernel; the process's kernel is restored after."""
    monkeypatch.setattr(native.LIBRARY, "lib", None)
    monkeypatch.setattr(native.LIBRARY, "status", None)
    monkeypatch.setenv("LLMHAL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LLMHAL_CPU_ATTN_KERNEL", raising=False)
    return tmp_path


@pytest.mark.parametrize("case", conformance_cases(CpuAttentionBackend), ids=lambda c: c.id)
def test_quick_conformance(case, path):
    check_attention_case(CpuAttentionBackend, case)


@pytest.mark.slow
def test_full_conformance_product(path):
    # block size 16/32 x head size 64/128/80 x GQA 1/4/8 x dtype x (window, soft-cap, fp8 e4m3/e5m2)
    report = run_attention_conformance(CpuAttentionBackend, dtypes=ALL_DTYPES, quick=False)
    report.raise_on_failure()
    assert len(report.results) == 2 * 3 * 3 * 3 * 6 and not report.skipped


# Shapes the suite's product does not reach: head sizes that are not a multiple of any vector
# width, block sizes of 1 and larger than the kernel's key tile, many query heads per KV head.
EXTRA_SHAPES = [
    dict(head_size=17, num_heads=4, num_kv_heads=2, block_size=16),
    dict(head_size=72, num_heads=6, num_kv_heads=2, block_size=8),
    dict(head_size=96, num_heads=7, num_kv_heads=1, block_size=64),
    dict(head_size=256, num_heads=4, num_kv_heads=4, block_size=1),
    dict(head_size=64, num_heads=16, num_kv_heads=1, block_size=128),
]
EXTRA_FEATURES = [
    dict(),
    dict(sliding_window=5, kv_cache_dtype="fp8_e4m3"),
    dict(logits_soft_cap=2.0, kv_cache_dtype="fp8_e5m2"),
]


def _extra_cases() -> list[AttentionCase]:
    cases = []
    for i, (shape, feat) in enumerate(itertools.product(EXTRA_SHAPES, EXTRA_FEATURES)):
        cases.append(AttentionCase(dtype=ALL_DTYPES[i % 3], seed=100 + i, **shape, **feat))
    return cases


@pytest.mark.parametrize("case", _extra_cases(), ids=lambda c: c.id)
def test_odd_shapes(case, path):
    check_attention_case(CpuAttentionBackend, case)


@pytest.mark.parametrize("window", [None, 37])
def test_long_decodes_split_across_threads(path, monkeypatch, window):
    # Few (token, KV head) items: the kernel splits each token's keys and merges the pieces.
    monkeypatch.setattr(cpu_attn, "MIN_SPLIT_TOKENS", 16)
    monkeypatch.setattr(cpu_attn, "PARKED_SPLIT_WORK", 0)
    case = AttentionCase(
        head_size=64,
        num_heads=8,
        num_kv_heads=1,
        dtype="float32",
        sliding_window=window,
        requests=((300, 1), (3, 1), (150, 1)),
    )
    check_attention_case(CpuAttentionBackend, case)


@pytest.mark.parametrize("layout", ["heads_outer", "padded_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cache_strides_other_than_contiguous_token_rows(layout, dtype):
    # The kernel reads a tile as one span of memory when each token's rows for all KV heads are
    # contiguous (the engine's layout) and head by head otherwise; both give the same numbers.
    lib = native.load_kernel()
    if lib is None:
        pytest.skip(f"native kernel unavailable here: {native.kernel_status()}")
    blocks, bs, hkv, d, heads = 12, 16, 3, 64, 9
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(blocks, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
    if layout == "heads_outer":  # [blocks, heads, tokens, d] in memory
        k2, v2 = (t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for t in (k, v))
    else:  # each token row padded to 4 heads
        k2, v2 = (torch.zeros(blocks, bs, hkv + 1, d, dtype=dtype)[:, :, :hkv] for _ in range(2))
        k2.copy_(k), v2.copy_(v)
    assert k2.equal(k) and k2.stride() != k.stride()
    seq_lens = torch.tensor([70, 5, 33, 48], dtype=torch.int32)
    table = torch.randperm(blocks, generator=g).to(torch.int32)[:12].view(4, 3)
    q = torch.randn(4, heads, d, generator=g)
    outs = []
    for kc, vc in ((k, v), (k2, v2)):
        out = torch.empty_like(q)
        native.paged_attention(
            lib, query=q, k_cache=kc, v_cache=vc, block_table=table, seq_lens=seq_lens,
            query_start_loc=torch.arange(5, dtype=torch.int32), num_reqs=4, out=out,
            num_kv_heads=hkv, scale=d**-0.5, soft_cap=None, k_scale=1.0, v_scale=1.0,
            window=None, min_split_tokens=1 << 20,
        )  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    # and both are attention: request 2 (33 keys) against a direct computation
    keys = torch.cat([k[b] for b in table[2].tolist()])[:33].float()
    vals = torch.cat([v[b] for b in table[2].tolist()])[:33].float()
    kk, vv = (t.repeat_interleave(heads // hkv, dim=1) for t in (keys, vals))
    w = torch.softmax(torch.einsum("hd,thd->ht", q[2], kk) * d**-0.5, dim=-1)
    torch.testing.assert_close(outs[0][2], torch.einsum("ht,thd->hd", w, vv), rtol=1e-4, atol=1e-5)


def test_short_query_chunks_use_the_kernel_route(path):
    # Query lengths up to KERNEL_MAX_QUERY_LEN (draft verification) share the decode call.
    n = cpu_attn.KERNEL_MAX_QUERY_LEN
    case = AttentionCase(
        head_size=64,
        num_heads=8,
        num_kv_heads=2,
        dtype="float32",
        sliding_window=6,
        requests=((20, 1), (33, 3), (9, n), (40, n + 1), (0, 4)),
    )
    check_attention_case(CpuAttentionBackend, case)
    common = build_common_metadata([q for _, q in case.requests], [c for c, _ in case.requests],
                                   [list(range(i * 4, i * 4 + 4)) for i in range(5)], 16)  # fmt: skip
    meta = cpu_attn.CpuAttentionMetadataBuilder(case.requirements(), torch.device("cpu")).build(
        common
    )
    assert meta.num_kernel_reqs == 3 and [p.req for p in meta.prefills] == [3, 4]


def test_tree_mask(path):
    case = AttentionCase(
        head_size=64,
        num_heads=4,
        num_kv_heads=2,
        dtype="float32",
        tree_size=5,
        requests=((12, 1), (7, 5), (30, 5), (0, 9)),
    )
    check_attention_case(CpuAttentionBackend, case)
    windowed = AttentionCase(**{**case.__dict__, "sliding_window": 4})
    result = run_attention_case(CpuAttentionBackend, windowed)
    assert result.failures and "sliding window together with a tree mask" in result.failures[0]


def test_padding_is_not_written_and_padding_rows_are_zero(path):
    d, hkv = 16, 2
    shape = CpuAttentionBackend.get_kv_cache_shape(3, 4, hkv, d)
    cache = torch.zeros(shape)
    common = build_common_metadata([1, 3], [2, 0], [[0], [1]], 4)
    common.slot_mapping[3] = -1  # the engine's padding token
    req = AttentionRequirements(
        head_size=d, num_heads=4, num_kv_heads=hkv, dtype=torch.float32, block_size=4
    )
    meta = cpu_attn.CpuAttentionMetadataBuilder(req, torch.device("cpu")).build(common)
    impl = cpu_attn.CpuAttentionImpl(4, d, 0.25, hkv)

    class Layer:
        k_scale = v_scale = torch.tensor(1.0)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, h, d, generator=g) for h in (4, hkv, hkv))  # 2 rows beyond the step
    out = impl.forward(Layer, q, k, v, cache, meta)
    assert out.shape == q.shape and out[4:].eq(0).all() and torch.isfinite(out[:4]).all()
    assert cache[0, 1, 2].eq(0).all() and cache[0, 1, 1].eq(k[2]).all()


def test_selected_by_default_on_the_cpu_platform(monkeypatch):
    from llmhal.attention.selector import _clear_cache_for_tests, select_attention_backend
    from llmhal.platforms import get_current_platform

    if get_current_platform().name != "cpu":
        pytest.skip("the CPU platform is not the active one")
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    _clear_cache_for_tests()
    for dtype, kv in [(torch.float32, "auto"), (torch.bfloat16, "fp8_e4m3")]:
        req = AttentionRequirements(
            head_size=80, num_heads=8, num_kv_heads=2, dtype=dtype, kv_cache_dtype=kv,
            block_size=32, sliding_window=64, logits_soft_cap=30.0,
        )  # fmt: skip
        assert select_attention_backend(req).name == "cpu_attn"
    _clear_cache_for_tests()


# ------------------------------------------------------------------------------ the native build
def test_missing_compiler_falls_back_to_torch_and_says_why(fresh_kernel_state, monkeypatch):
    monkeypatch.setattr(native.LIBRARY, "compiler", lambda: None)
    assert native.load_kernel() is None
    assert "no C++ compiler" in native.kernel_status()
    case = conformance_cases(CpuAttentionBackend)[1]
    check_attention_case(CpuAttentionBackend, case)


def test_failed_build_falls_back(fresh_kernel_state, monkeypatch, tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native.LIBRARY, "source", broken)
    if native.LIBRARY.compiler() is None:
        pytest.skip("no compiler")
    assert native.load_kernel() is None
    assert "failed" in native.kernel_status()


@pytest.mark.parametrize("arch", ["-march=haswell", "-march=x86-64"], ids=["avx2", "sse2"])
def test_portable_builds_are_correct_and_cached(fresh_kernel_state, monkeypatch, arch):
    # The product must not assume AVX-512: build the AVX2+FMA+F16C code path, and the baseline
    # x86-64 one (4-wide vectors, integer fp16/fp8 conversions), and run the suite on each.
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64") or native.LIBRARY.compiler() is None:
        pytest.skip("x86-64 with a C++ compiler only")
    monkeypatch.setenv("LLMHAL_CPU_KERNEL_ARCH", arch)
    assert native.load_kernel() is not None, native.kernel_status()
    built = list(fresh_kernel_state.glob("kernels/paged_attention-*.so"))
    assert len(built) == 1
    run_attention_conformance(CpuAttentionBackend, dtypes=ALL_DTYPES).raise_on_failure()
    # A second process (simulated) reuses the cached binary instead of compiling again.
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native.LIBRARY, "lib", None)
    monkeypatch.setattr(native.LIBRARY, "status", None)
    assert native.load_kernel() is not None
    assert [p.stat().st_mtime_ns for p in fresh_kernel_state.glob("kernels/*.so")] == [stamp]


def test_unwritable_cache_dir_falls_back_to_temp(fresh_kernel_state, monkeypatch):
    if native.LIBRARY.compiler() is None:
        pytest.skip("no compiler")
    blocker = fresh_kernel_state / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LLMHAL_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr("tempfile.tempdir", str(fresh_kernel_state / "tmp"))
    (fresh_kernel_state / "tmp").mkdir()
    assert native.load_kernel() is not None, native.kernel_status()
    assert list((fresh_kernel_state / "tmp").glob("llmhal-*/kernels/paged_attention-*.so"))


def test_parked_threads_split_only_work_worth_a_wake_up(monkeypatch):
    monkeypatch.setattr(cpu_attn, "PARKED_SPLIT_WORK", 1 << 19)
    assert cpu_attn.min_split_tokens(9, 64) == 911  # SmolLM2: a split must cover ~900 keys
    assert cpu_attn.min_split_tokens(32, 128) == cpu_attn.MIN_SPLIT_TOKENS
    monkeypatch.setattr(cpu_attn, "PARKED_SPLIT_WORK", 0)
    assert cpu_attn.min_split_tokens(9, 64) == cpu_attn.MIN_SPLIT_TOKENS
