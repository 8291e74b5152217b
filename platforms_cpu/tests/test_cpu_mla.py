"""``cpu_mla``: the native MLA decode kernel against the float64 dense attention, its fallback, a
recorded decode step replaying new values, and the rotary of a strided query view (DeepSeek's q_pe).
"""

from __future__ import annotations

import random

import pytest
import torch

from llmhal.attention.backend import AttentionRequirements
from llmhal.attention.batch import build_common_metadata
from llmhal.attention.mla.common import MLADims
from llmhal.attention.mla.torch_mla import TorchMLABackend
from llmhal.ops import native as native_ops
from llmhal.testing.mla_steps import (
    BLOCK,
    DIMS,
    SCALE,
    StubLayer,
    dense,
    relative_error,
    run_steps,
)
from llmhal_cpu import native_build, step_graph
from llmhal_cpu.attention.cpu_mla import CpuMLABackend
from llmhal_cpu.kernels import fused_ops, mla_decode

# Skipped only without a compiler: a kernel that fails to build fails these tests.
needs_kernel = pytest.mark.skipif(native_build.compiler() is None, reason="no C++ compiler")


@needs_kernel
def test_the_kernel_builds():
    assert mla_decode.LIBRARY.get() is not None, mla_decode.LIBRARY.status
    assert mla_decode.status().startswith("native")


@needs_kernel
def test_float32_matches_dense_attention():
    out, want = run_steps(CpuMLABackend, StubLayer(DIMS))
    assert out.shape == (14, DIMS.num_heads, DIMS.v_head_dim)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


@needs_kernel
def test_bf16_as_close_to_dense_as_torch_mla():
    """bf16 rounds the absorbed query, the probabilities and the latent output where the host has
    AVX512-BF16 dots (as torch's bf16 path does), else only the output: no further than torch."""
    out, want = run_steps(CpuMLABackend, StubLayer(DIMS), dtype=torch.bfloat16)
    torch_out, _ = run_steps(TorchMLABackend, StubLayer(DIMS), dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, want) < 3e-2
    # All 14 rows are the kernel's here (two decodes, a 5-token chunk, a 7-token prefill).
    assert relative_error(out, want) <= 1.5 * relative_error(torch_out, want)


@needs_kernel
def test_bf16_packed_weights_at_odd_and_multi_tile_shapes():
    """With AVX512-BF16 the W_UK and W_UV products read the weights packed in pairs, in tiles of
    64 columns: an odd nope and latent size (a half-empty last pair) and several tiles with a
    ragged last one (L 137, v 70) give the dense attention as closely as torch_mla does."""
    dims = MLADims(num_heads=3, qk_nope_head_dim=15, qk_rope_head_dim=8, v_head_dim=70,
                   kv_lora_rank=137)  # fmt: skip
    out, want = run_steps(CpuMLABackend, StubLayer(dims), dtype=torch.bfloat16)
    torch_out, _ = run_steps(TorchMLABackend, StubLayer(dims), dtype=torch.bfloat16)
    assert relative_error(out, want) < 3e-2
    assert relative_error(out, want) <= 1.5 * relative_error(torch_out, want)


@needs_kernel
def test_two_threads_give_the_one_thread_result():
    dims = MLADims(num_heads=40, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                   kv_lora_rank=40)  # fmt: skip  # several head groups (16 or 32 heads), vector tails
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, want = run_steps(CpuMLABackend, StubLayer(dims))
        torch.set_num_threads(2)
        two, _ = run_steps(CpuMLABackend, StubLayer(dims))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one.double(), want, atol=2e-5, rtol=2e-5)
    # The decode rows (the kernel's; each head group's sums run in one order on any thread).
    assert torch.equal(one[:2], two[:2])


def test_kernel_off_runs_torch_mla(monkeypatch):
    monkeypatch.setenv("LLMHAL_CPU_MLA_KERNEL", "0")
    out, _ = run_steps(CpuMLABackend, StubLayer(DIMS), dtype=torch.bfloat16)
    want, _ = run_steps(TorchMLABackend, StubLayer(DIMS), dtype=torch.bfloat16)
    assert torch.equal(out, want)
    assert "LLMHAL_CPU_MLA_KERNEL=0" in mla_decode.status()


def test_fp8_latent_cache_takes_torch_mla():
    """The kernel reads model-dtype caches only; fp8 steps run torch_mla's ops, same values."""
    out, want = run_steps(CpuMLABackend, StubLayer(DIMS), cache_dtype="fp8_e4m3")
    ref, _ = run_steps(TorchMLABackend, StubLayer(DIMS), cache_dtype="fp8_e4m3")
    assert torch.equal(out, ref)
    assert relative_error(out, want) < 0.1


class _StaticStep:
    """Requests with cached context adding ``q_lens`` tokens each (1: a decode; more: a prompt
    chunk), over static metadata tensors (as the decode-graph runner keeps them) that
    :meth:`advance` refills in place for the next step of the same shape."""

    def __init__(self, dims: MLADims, dtype: torch.dtype, q_lens: tuple[int, ...]) -> None:
        self.dims, self.dtype, self.q_lens = dims, dtype, q_lens
        self.layer = StubLayer(dims, seed=1)
        self.layer.mla_weights(dtype, torch.device("cpu"))  # cast, as the prefill steps did
        self.g = torch.Generator().manual_seed(5)
        free = list(range(40))
        random.Random(1).shuffle(free)
        self.lens = [5, 11, 2][: len(q_lens)]  # tokens cached before this step
        self.tables = [[free.pop() for _ in range(8)] for _ in self.lens]
        d = dims
        self.cache = torch.randn(40, BLOCK, d.latent_size, generator=self.g).to(dtype)
        self.common = build_common_metadata(list(q_lens), self.lens, self.tables, BLOCK)
        req = AttentionRequirements(
            head_size=d.latent_size, num_heads=d.num_heads, num_kv_heads=1, dtype=dtype,
            block_size=BLOCK, kind="mla",
        )  # fmt: skip
        self.meta = CpuMLABackend.get_builder_cls()(req, torch.device("cpu")).build(self.common)
        self.impl = CpuMLABackend.get_impl_cls()(d.num_heads, d.latent_size, SCALE, 1)
        t = sum(q_lens)
        self.q = torch.empty(t, d.num_heads, d.qk_head_dim, dtype=dtype)
        self.kv_c = torch.empty(t, d.kv_lora_rank, dtype=dtype)
        self.k_pe = torch.empty(t, d.qk_rope_head_dim, dtype=dtype)
        self.refill()

    def refill(self) -> None:
        for t in (self.q, self.kv_c, self.k_pe):
            t.copy_(torch.randn(t.shape, generator=self.g))

    def _positions(self) -> list[tuple[int, int]]:
        """(request, position) of each query row."""
        pairs = enumerate(zip(self.lens, self.q_lens, strict=True))
        return [(i, n + j) for i, (n, q) in pairs for j in range(q)]

    def advance(self) -> None:
        """The next step: every request its q tokens longer, new inputs, the same buffers."""
        self.lens = [n + q for n, q in zip(self.lens, self.q_lens, strict=True)]
        c = self.common
        c.seq_lens.add_(torch.tensor(self.q_lens, dtype=c.seq_lens.dtype))
        for row, (i, p) in enumerate(self._positions()):
            c.positions[row] = p
            c.slot_mapping[row] = self.tables[i][p // BLOCK] * BLOCK + p % BLOCK
        self.refill()

    def forward(self) -> torch.Tensor:
        return self.impl.forward(self.layer, self.q, self.kv_c, self.k_pe, self.cache, self.meta)

    def expected(self) -> torch.Tensor:
        """The float64 dense attention of this step over what the cache holds after it."""
        flat = self.cache.view(-1, self.dims.latent_size).double()
        rows = []
        for row, (i, p) in enumerate(self._positions()):
            slots = [self.tables[i][s // BLOCK] * BLOCK + s % BLOCK for s in range(p + 1)]
            c, k_pe = flat[slots].split([self.dims.kv_lora_rank, self.dims.qk_rope_head_dim], -1)
            q = self.q[row : row + 1].double()
            rows.append(dense(self.layer, q, c, k_pe, torch.tensor([p])))
        return torch.cat(rows)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens", [(1, 1, 1), (1, 1, 3)], ids=["decodes", "with-a-chunk"])
def test_a_step_is_recorded_and_replays_new_values(dtype, q_lens):
    """Decodes, and decodes beside a short prompt chunk (what a server's mixed steps are)."""
    step = _StaticStep(DIMS, dtype, q_lens)
    out, graph, reason = step_graph.capture(step.forward)
    assert graph is not None, reason
    assert graph.num_calls == 1  # latents stored, attended and projected in one native call
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert relative_error(out, step.expected()) < tol
    for _ in range(3):  # the replays cross block boundaries (4-token blocks)
        step.advance()
        graph.replay()
        assert relative_error(out, step.expected()) < tol
        torch.testing.assert_close(out, step.forward())  # and equal to the eager call


@needs_kernel
def test_a_slot_outside_the_cache_is_refused_before_anything_is_written():
    step = _StaticStep(DIMS, torch.float32, (1, 1, 1))
    before = step.cache.clone()
    step.common.slot_mapping[1] = step.cache.shape[0] * BLOCK
    with pytest.raises(IndexError, match="slot_mapping is outside the latent cache"):
        step.forward()
    assert torch.equal(step.cache, before)


@needs_kernel
@pytest.mark.parametrize("short", ["query", "out"])
def test_query_rows_past_the_query_or_out_are_refused_before_anything_is_written(short):
    """The kernel reads and writes query_start_loc[num_reqs] rows of the query and out (the
    device's offsets, not the host's num_rows): more than either holds is an error, not a read or
    write past their ends."""
    step = _StaticStep(DIMS, torch.float32, (1, 1, 1))
    m, d = step.meta, DIMS
    assert int(m.query_start_loc[m.num_kernel_reqs]) == 3
    w_uk, w_uv = step.layer.mla_weights(torch.float32, torch.device("cpu"))
    query = step.q[:2] if short == "query" else step.q
    out = torch.empty(2 if short == "out" else 3, d.num_heads, d.v_head_dim)
    before = step.cache.clone()
    with pytest.raises(IndexError, match="more than the rows of the query or of out"):
        mla_decode.mla_decode(
            d, SCALE, query, step.kv_c, step.k_pe, step.cache, m.slots, m.query_start_loc,
            m.block_table, m.seq_lens, m.num_kernel_reqs, 2, w_uk, w_uv, out,
        )  # fmt: skip  # num_rows 2: a host count out of step with the offsets
    assert torch.equal(step.cache, before)


def test_mla_layers_get_cpu_mla_on_the_cpu():
    from llmhal_cpu.platform import CpuPlatform

    req = AttentionRequirements(
        head_size=288, num_heads=8, num_kv_heads=1, dtype=torch.bfloat16, kind="mla"
    )
    assert CpuPlatform().attention_backend_priority(req) == ["cpu_mla"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rotates_a_strided_query_view_in_place(dtype):
    """DeepSeek's rotary part of each head (the last 8 of 24 values here) and the shared key,
    rotated where they lie, as the native definition rotates copies of them."""
    if fused_ops.load_library() is None:
        pytest.skip(f"no native fused_ops ({fused_ops.LIBRARY.status})")
    g = torch.Generator().manual_seed(0)
    t, heads, nope, rope = 5, 3, 16, 8
    q = torch.randn(t, heads, nope + rope, generator=g).to(dtype)
    kv = torch.randn(t, 32 + rope, generator=g).to(dtype)
    cache = torch.randn(64, rope, generator=g)
    positions = torch.tensor([0, 3, 7, 63, 12])
    q_pe, k_pe = q[..., nope:], kv[:, 32:]
    want_q, want_k = native_ops.rotary_embedding(
        positions, q_pe.clone(), k_pe.clone(), cache, rope, False
    )
    before_nope = q[..., :nope].clone()
    assert fused_ops.rotary_(positions, q_pe, k_pe, cache, rope, False)
    torch.testing.assert_close(q_pe, want_q.view(t, heads, rope), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k_pe, want_k, atol=1e-2, rtol=1e-2)
    assert torch.equal(q[..., :nope], before_nope)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["-march=haswell", "-march=x86-64"], ids=["avx2", "sse2"])
def test_portable_builds_match(monkeypatch, tmp_path, arch):
    """The kernel must not assume AVX-512: the AVX2 build (what CI may have) and the baseline
    x86-64 one give the dense attention too."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64") or native_build.compiler() is None:
        pytest.skip("x86-64 with a C++ compiler only")
    monkeypatch.setenv("LLMHAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LLMHAL_CPU_KERNEL_ARCH", arch)
    monkeypatch.setattr(mla_decode.LIBRARY, "lib", None)
    monkeypatch.setattr(mla_decode.LIBRARY, "status", None)
    assert mla_decode.LIBRARY.get() is not None, mla_decode.LIBRARY.status
    assert len(list(tmp_path.glob("kernels/mla_decode-*.so"))) == 1
    out, want = run_steps(CpuMLABackend, StubLayer(DIMS))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    out, want = run_steps(CpuMLABackend, StubLayer(DIMS), dtype=torch.bfloat16)
    assert relative_error(out, want) < 3e-2
