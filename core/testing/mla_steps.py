"""A two-step MLA workload for backend tests: decodes, a prefill chunk after cached tokens and a
fresh prefill over a shuffled paged latent cache, with the float64 dense attention each step should
equal (keys and values expanded per head from the same latents). Shared by core's MLA tests and
platform packages' MLA backend tests.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from llmhal.attention.backend import AttentionRequirements
from llmhal.attention.batch import build_common_metadata
from llmhal.attention.mla.common import MLADims

DIMS = MLADims(num_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, kv_lora_rank=32)
BLOCK = 4
SCALE = 0.21


class StubLayer:
    """What an MLA impl reads from its layer: the sizes, the split kv_b_proj weight, the scale."""

    def __init__(self, dims: MLADims, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.dims = dims
        self.w_uk = (
            torch.randn(dims.num_heads, dims.qk_nope_head_dim, dims.kv_lora_rank, generator=g) * 0.2
        )
        self.w_uv = (
            torch.randn(dims.num_heads, dims.v_head_dim, dims.kv_lora_rank, generator=g) * 0.2
        )
        self.k_scale = torch.tensor(1.0)
        self.v_scale = torch.tensor(1.0)
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def mla_weights(
        self, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Cast once per dtype, as MLAAttention caches them: a recorded step must not cast.
        if dtype not in self._cast:
            self._cast[dtype] = (self.w_uk.to(dtype), self.w_uv.to(dtype))
        return self._cast[dtype]


def dense(
    layer: StubLayer,
    q: torch.Tensor,
    c: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """float64 attention of queries ``q`` [t, H, D] at ``positions`` over all keys [S]."""
    d = layer.dims
    w_uk, w_uv = layer.w_uk.double().cpu(), layer.w_uv.double().cpu()
    k = torch.cat(
        [torch.einsum("sl,hnl->shn", c, w_uk), k_pe[:, None].expand(-1, d.num_heads, -1)], -1
    )
    v = torch.einsum("sl,hvl->shv", c, w_uv)
    scores = torch.einsum("thd,shd->hts", q, k) * SCALE
    mask = torch.arange(c.shape[0])[None, :] <= positions[:, None]
    probs = scores.masked_fill(~mask[None], float("-inf")).softmax(-1)
    return torch.einsum("hts,shv->thv", probs, v)


def run_steps(
    backend: Any,
    layer: StubLayer,
    dtype: torch.dtype = torch.float32,
    cache_dtype: str = "auto",
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 prefills (6, 9 and 3 tokens); step 2 decodes two of them, adds a 5-token chunk to
    the third and prefills a new 7-token request. Returns the step-2 output (on the host) and its
    dense twin."""
    dev = torch.device(device)
    d = layer.dims
    g = torch.Generator().manual_seed(3)
    num_blocks = 32
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    req = AttentionRequirements(
        head_size=d.latent_size, num_heads=d.num_heads, num_kv_heads=1, dtype=dtype,
        kv_cache_dtype=cache_dtype, block_size=BLOCK, kind="mla",
    )  # fmt: skip
    shape = backend.get_kv_cache_shape(num_blocks, BLOCK, 1, d.latent_size, cache_dtype)
    cache = torch.zeros(shape, dtype=backend.kv_cache_torch_dtype(dtype, cache_dtype), device=dev)
    impl = backend.get_impl_cls()(d.num_heads, d.latent_size, SCALE, 1, kv_cache_dtype=cache_dtype)
    builder = backend.get_builder_cls()(req, dev)
    tokens: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # request -> (c, k_pe) so far
    tables: dict[int, list[int]] = {}

    def step(items: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        lens, computed, blocks, qs, cs, ps = [], [], [], [], [], []
        for rid, n in items:
            start = tokens[rid][0].shape[0] if rid in tokens else 0
            table = tables.setdefault(rid, [])
            while len(table) * BLOCK < start + n:
                table.append(free.pop())
            c = torch.randn(n, d.kv_lora_rank, generator=g)
            p = torch.randn(n, d.qk_rope_head_dim, generator=g)
            old = tokens.get(rid, (c[:0], p[:0]))
            tokens[rid] = (torch.cat([old[0], c]), torch.cat([old[1], p]))
            lens.append(n), computed.append(start), blocks.append(list(table))
            (
                qs.append(torch.randn(n, d.num_heads, d.qk_head_dim, generator=g)),
                cs.append(c),
                ps.append(p),
            )
        common = build_common_metadata(lens, computed, blocks, BLOCK, dev)
        q, c, p = torch.cat(qs), torch.cat(cs), torch.cat(ps)
        out = impl.forward(
            layer, *(x.to(dev, dtype) for x in (q, c, p)), cache, builder.build(common)
        ).cpu()
        want, row = [], 0
        for (rid, n), start in zip(items, computed, strict=True):
            allc, allp = tokens[rid]
            pos = torch.arange(start, start + n)
            want.append(dense(layer, q[row : row + n].double(), allc.double(), allp.double(), pos))
            row += n
        return out, torch.cat(want)

    step([(0, 6), (1, 9), (2, 3)])
    return step([(0, 1), (1, 1), (2, 5), (3, 7)])


# Largest error of a backend's output relative to the largest dense value: float32 computes in
# float32 throughout; 16-bit models round activations, weights and the cache (bf16 keeps 8 bits).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def relative_error(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.double() - want).abs().max() / want.abs().max())


def check_mla_backend(
    backend: Any, device: torch.device | str, dtypes: list[torch.dtype]
) -> list[str]:
    """What is wrong with an MLA backend on this workload, per dtype (empty: nothing); the
    conformance kit's check for backends of kind ``mla``."""
    problems = []
    for dtype in dtypes:
        layer = StubLayer(DIMS)
        layer.w_uk, layer.w_uv = layer.w_uk.to(device), layer.w_uv.to(device)
        try:
            out, want = run_steps(backend, layer, dtype, device=device)
        except Exception as e:  # reported as the finding, not raised
            problems.append(f"{dtype}: {type(e).__name__}: {e}")
            continue
        err = relative_error(out, want)
        if not err <= TOLERANCE[dtype]:
            problems.append(f"{dtype}: off the dense attention by {err:.2e} (> {TOLERANCE[dtype]})")
    return problems
