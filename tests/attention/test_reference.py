"""The reference backend against torch SDPA (and float64 math), and the conformance suite's teeth."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from llmhal.attention import paged_kv
from llmhal.attention.batch import build_common_metadata
from llmhal.attention.reference import (
    ReferenceAttentionBackend,
    ReferenceAttentionImpl,
    ReferenceMetadataBuilder,
)
from llmhal.testing.attention_conformance import (
    AttentionCase,
    conformance_cases,
    random_tree_mask,
    run_attention_case,
    run_attention_conformance,
)

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


class _Layer:
    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        self.k_scale = torch.tensor(k_scale)
        self.v_scale = torch.tensor(v_scale)


def _run_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ctx: int,
    block_size: int = 16,
    window: int | None = None,
    cap: float | None = None,
    kv_cache_dtype: str = "auto",
    layer: _Layer | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One request of len(k) tokens: ``ctx`` cached by a first step, the rest in a second step."""
    n, h, d = q.shape
    hkv = k.shape[1]
    layer = layer or _Layer()
    blocks = -(-n // block_size)
    table = list(range(blocks))[::-1]  # non-identity placement
    cache = torch.zeros(
        ReferenceAttentionBackend.get_kv_cache_shape(blocks + 1, block_size, hkv, d),
        dtype=ReferenceAttentionBackend.kv_cache_torch_dtype(q.dtype, kv_cache_dtype),
    )
    impl = ReferenceAttentionImpl(
        h,
        d,
        d**-0.5,
        hkv,
        sliding_window=window,
        logits_soft_cap=cap,
        kv_cache_dtype=kv_cache_dtype,
    )
    builder = ReferenceMetadataBuilder(None, torch.device("cpu"))  # type: ignore[arg-type]
    if ctx:
        common = build_common_metadata([ctx], [0], [table], block_size)
        impl.forward(layer, q[:ctx], k[:ctx], v[:ctx], cache, builder.build(common))
    common = build_common_metadata([n - ctx], [ctx], [table], block_size, tree_mask=tree_mask)
    return impl.forward(layer, q[ctx:], k[ctx:], v[ctx:], cache, builder.build(common))


def _sdpa(q, k, v, mask, scale=None):  # [n, H, D] layout; mask bool [nq, nk]
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1)


def _causal(n: int, window: int | None = None) -> torch.Tensor:
    i = torch.arange(n)
    m = i[None, :] <= i[:, None]
    if window:
        m &= i[None, :] > i[:, None] - window
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("h", "hkv", "d", "ctx", "window"),
    [(4, 4, 64, 0, None), (8, 2, 80, 21, None), (8, 1, 128, 37, 9), (6, 3, 32, 50, 1)],
)
def test_reference_matches_sdpa(dtype, h, hkv, d, ctx, window):
    g = torch.Generator().manual_seed(h * 100 + d + ctx)
    n = ctx + 23
    q, k, v = (torch.randn(n, x, d, generator=g).to(dtype) for x in (h, hkv, hkv))
    out = _run_reference(q, k, v, ctx=ctx, window=window)
    ref = _sdpa(q.float(), k.float(), v.float(), _causal(n, window))[ctx:]
    assert out.dtype == dtype and out.shape == (n - ctx, h, d)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_reference_soft_cap_matches_float64_math():
    g = torch.Generator().manual_seed(1)
    n, h, hkv, d, ctx, cap = 30, 4, 2, 64, 11, 1.5
    q, k, v = (torch.randn(n, x, d, generator=g) * 2 for x in (h, hkv, hkv))
    out = _run_reference(q, k, v, ctx=ctx, cap=cap, window=7)
    q64, k64, v64 = (
        q.double(),
        k.double().repeat_interleave(2, 1),
        v.double().repeat_interleave(2, 1),
    )
    s = torch.einsum("qhd,khd->hqk", q64, k64) / math.sqrt(d)
    s = cap * torch.tanh(s / cap)
    s = s.masked_fill(~_causal(n, 7), -math.inf)
    ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), v64)[ctx:]
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # the cap really changes the result at this scale
    plain = _run_reference(q, k, v, ctx=ctx, window=7)
    assert (plain - out).abs().max() > 1e-2


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_reference_fp8_cache_reads_back_scaled_values(kv_cache_dtype):
    g = torch.Generator().manual_seed(2)
    n, h, hkv, d, ctx = 40, 4, 2, 64, 25
    q, k, v = (torch.randn(n, x, d, generator=g) for x in (h, hkv, hkv))
    k[3, 0, 0] = 1e4  # saturates instead of turning into NaN
    layer = _Layer(0.05, 0.03)
    out = _run_reference(q, k, v, ctx=ctx, kv_cache_dtype=kv_cache_dtype, layer=layer)
    fp8 = torch.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else torch.float8_e5m2
    fmax = torch.finfo(fp8).max
    kq = (k / 0.05).clamp(-fmax, fmax).to(fp8).float() * 0.05
    vq = (v / 0.03).clamp(-fmax, fmax).to(fp8).float() * 0.03
    ref = _sdpa(q, kq, vq, _causal(n))[ctx:]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()
    # quantization is visible: the unquantized result differs
    assert (out - _sdpa(q, k, v, _causal(n))[ctx:]).abs().max() > 1e-3


def test_reference_tree_mask():
    g = torch.Generator().manual_seed(3)
    n, h, d, ctx, t = 26, 4, 64, 20, 6
    q, k, v = (torch.randn(n, h, d, generator=g) for _ in range(3))
    tree = random_tree_mask(t, g)
    out = _run_reference(q, k, v, ctx=ctx, tree_mask=tree)
    mask = torch.ones(t, n, dtype=torch.bool)
    mask[:, ctx:] = tree
    ref = _sdpa(q[ctx:], k, v, mask)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="sliding window together with a tree mask"):
        _run_reference(q, k, v, ctx=ctx, tree_mask=tree, window=4)


def test_padding_slots_are_skipped_and_padding_rows_zero():
    layer, d = _Layer(), 16
    cache = torch.zeros(paged_kv.kv_cache_shape(2, 4, 1, d))
    common = build_common_metadata([3], [0], [[1]], 4)
    common.slot_mapping[2] = -1  # the engine's padding token
    impl = ReferenceAttentionImpl(1, d, 0.25, 1)
    meta = ReferenceMetadataBuilder(None, torch.device("cpu")).build(common)  # type: ignore[arg-type]
    x = torch.ones(4, 1, d)
    out = impl.forward(layer, x, x, x, cache, meta)
    assert cache[0, 1, :2].eq(1).all() and cache[0, 1, 2:].eq(0).all() and cache[0, 0].eq(0).all()
    assert out[3].eq(0).all()


def test_reference_passes_its_own_quick_suite():
    report = run_attention_conformance(ReferenceAttentionBackend, dtypes=("float32", "bfloat16"))
    report.raise_on_failure()
    assert len(report.results) == 6 and not report.skipped


# ------------------------------------------------------------- the suite catches real mistakes
class _OffByOneWindow(ReferenceAttentionImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata):
        self.sliding_window = self.sliding_window + 1 if self.sliding_window else None
        try:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata)
        finally:
            self.sliding_window = self.sliding_window - 1 if self.sliding_window else None


class _IgnoresKScale(ReferenceAttentionImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata):
        return super().forward(
            _Layer(1.0, float(layer.v_scale)), query, key, value, kv_cache, attn_metadata
        )


class _ReadsOwnKeysOnly(ReferenceAttentionImpl):
    """Ignores the cache: attends over the step's own new tokens (forgets cached context)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata):
        c = attn_metadata.common
        fresh = build_common_metadata(
            [int(x) for x in c.query_lens_cpu()],
            [0] * c.num_reqs,
            c.block_table.tolist(),
            kv_cache.shape[2],
        )
        return super().forward(
            layer,
            query,
            key,
            value,
            kv_cache,
            ReferenceMetadataBuilder(None, query.device).build(fresh),
        )


def _broken(impl):
    return type(
        f"Broken{impl.__name__}",
        (ReferenceAttentionBackend,),
        {"name": "broken", "get_impl_cls": staticmethod(lambda: impl)},
    )


@pytest.mark.parametrize(
    ("impl", "case"),
    [
        (_OffByOneWindow, AttentionCase(64, 4, 4, "float32", sliding_window=13)),
        (_IgnoresKScale, AttentionCase(64, 8, 2, "float32", kv_cache_dtype="fp8_e4m3")),
        (_ReadsOwnKeysOnly, AttentionCase(64, 4, 4, "float32")),
    ],
    ids=["window", "k_scale", "cache"],
)
def test_suite_detects_broken_backends(impl, case):
    result = run_attention_case(_broken(impl), case)
    assert result.failures and not result.skipped, result


def test_suite_skips_unsupported_with_reasons():
    limited = type(
        "Limited",
        (ReferenceAttentionBackend,),
        {
            "name": "limited",
            "supported_head_sizes": (64, 96),
            "supported_kv_cache_dtypes": ("auto",),
            "supports_logits_soft_cap": False,
        },
    )
    cases = conformance_cases(limited)
    assert {c.head_size for c in cases} == {64, 128, 96}  # the odd size comes from the backend
    results = [run_attention_case(limited, c) for c in cases]
    skipped = {r.case.id: r.skipped for r in results if r.skipped}
    assert any("head_size 128 not supported" in " ".join(s) for s in skipped.values())
    assert any("logits soft-capping not supported" in " ".join(s) for s in skipped.values())
    assert any("kv_cache_dtype fp8_e4m3 not supported" in " ".join(s) for s in skipped.values())
    assert all(r.passed for r in results if not r.skipped)
