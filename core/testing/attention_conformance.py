"""The attention conformance suite: any backend against the pure-torch ``reference``.

Each case builds a random paged KV cache (shuffled, non-contiguous blocks; unused slots hold large
garbage values so a backend that reads outside its request is caught), then runs two steps through
the backend's own builder and ``forward`` *and* through ``reference``, each on its own cache:

1. a prefill of every request's cached context (so the backend writes the cache itself);
2. a mixed step: decodes first, then prefill chunks that continue a cached context, then fresh
   prefills (and, for ``tree`` backends, draft trees to verify).

Outputs of both steps must match within a per-dtype tolerance (:data:`TOLERANCES`). A combination
the backend's ``validate`` rejects is skipped with those reasons, never failed.

Use from pytest (platform packages parametrize their own tests)::

    from llmhal.testing.attention_conformance import check_attention_case, conformance_cases

    @pytest.mark.parametrize("case", conformance_cases(MyBackend), ids=lambda c: c.id)
    def test_my_backend(case):
        check_attention_case(MyBackend, case, device="cpu")

or all at once: ``run_attention_conformance(MyBackend, device="cpu").raise_on_failure()``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from llmhal.attention.backend import AttentionBackend, AttentionRequirements
from llmhal.attention.batch import build_common_metadata
from llmhal.attention.kv_formats import packed_format

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.platforms import Platform

# (atol, rtol) of the comparison, per model dtype; fp8 KV caches add FP8_EXTRA_ATOL (a backend that
# quantizes with a different rounding order may land one fp8 step away on a few values).
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-4),
    "float16": (4e-3, 4e-3),
    "bfloat16": (2.5e-2, 2.5e-2),
}
FP8_EXTRA_ATOL = 2e-2
# The fp8 scales used by the suite: not 1.0, so a backend that ignores them fails.
K_SCALE, V_SCALE = 0.05, 0.03
GQA_SHAPES = {1: (4, 4), 4: (8, 2), 8: (8, 1)}  # ratio -> (num_heads, num_kv_heads)
GQA_SHAPES_KEYS = tuple(GQA_SHAPES)
DEFAULT_ODD_HEAD_SIZE = 80
SLIDING_WINDOW = 13
SOFT_CAP = 1.5


@dataclass(frozen=True)
class AttentionCase:
    """One conformance configuration. ``requests`` are (cached context, new tokens) of the mixed step."""

    head_size: int
    num_heads: int
    num_kv_heads: int
    dtype: str
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    kind: str = "mha"
    requests: tuple[tuple[int, int], ...] = ((19, 1), (40, 1), (7, 1), (23, 9), (0, 17), (0, 5))
    tree_size: int | None = (
        None  # tree cases: requests with this many new tokens verify a draft tree
    )
    seed: int = 0

    @property
    def id(self) -> str:
        parts = [
            self.dtype.replace("float", "f"),
            f"hs{self.head_size}",
            f"h{self.num_heads}kv{self.num_kv_heads}",
            f"bs{self.block_size}",
        ]
        if self.kv_cache_dtype != "auto":
            parts.append(self.kv_cache_dtype)
        if self.sliding_window:
            parts.append(f"sw{self.sliding_window}")
        if self.logits_soft_cap:
            parts.append(f"cap{self.logits_soft_cap:g}")
        if self.tree_size:
            parts.append(f"tree{self.tree_size}")
        return "-".join(parts)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def requirements(self, platform: Platform | None = None) -> AttentionRequirements:
        cap = platform.device_capability() if platform is not None else None
        return AttentionRequirements(
            head_size=self.head_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            dtype=self.torch_dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            block_size=self.block_size,
            kind=self.kind,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            device_capability=tuple(cap) if cap else None,
        )


@dataclass(frozen=True)
class CaseResult:
    """The outcome of one case. ``skipped`` holds the backend's reasons when it was not run."""

    case: AttentionCase
    skipped: tuple[str, ...] = ()
    max_abs_err: float = 0.0
    failures: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.skipped and not self.failures


@dataclass(frozen=True)
class ConformanceReport:
    backend: str
    results: tuple[CaseResult, ...] = field(default_factory=tuple)

    @property
    def failed(self) -> list[CaseResult]:
        return [r for r in self.results if r.failures]

    @property
    def skipped(self) -> list[CaseResult]:
        return [r for r in self.results if r.skipped]

    def summary(self) -> str:
        lines = [
            f"{self.backend}: {sum(r.passed for r in self.results)} passed, "
            f"{len(self.failed)} failed, {len(self.skipped)} skipped"
        ]
        for r in self.failed:
            lines.append(f"  FAIL {r.case.id}: " + "; ".join(r.failures))
        for r in self.skipped:
            lines.append(f"  skip {r.case.id}: " + "; ".join(r.skipped))
        return "\n".join(lines)

    def raise_on_failure(self) -> ConformanceReport:
        if self.failed:
            raise AssertionError(self.summary())
        return self


# ------------------------------------------------------------------------------------------ cases
def _default_dtypes(backend_cls: type[AttentionBackend]) -> tuple[str, ...]:
    ok = [d for d in ("float32", "bfloat16") if d in backend_cls.supported_dtypes]
    return tuple(ok) or tuple(backend_cls.supported_dtypes[:1])


def _odd_head_size(backend_cls: type[AttentionBackend]) -> int | None:
    sizes = backend_cls.supported_head_sizes
    if sizes is None:
        return DEFAULT_ODD_HEAD_SIZE
    odd = [s for s in sizes if s not in (64, 128)]
    return min(odd, key=lambda s: abs(s - DEFAULT_ODD_HEAD_SIZE)) if odd else None


# (sliding_window, logits_soft_cap, kv_cache_dtype) variants of a shape.
_FEATURES: tuple[tuple[int | None, float | None, str], ...] = (
    (None, None, "auto"),
    (SLIDING_WINDOW, None, "auto"),
    (None, SOFT_CAP, "auto"),
    (SLIDING_WINDOW, SOFT_CAP, "auto"),
    (None, None, "fp8_e4m3"),
    (SLIDING_WINDOW, None, "fp8_e5m2"),
)


def _tree_requests(rng: random.Random, tree_size: int) -> tuple[tuple[int, int], ...]:
    # Decodes first, then draft trees after a cached prefix, then a prefill of another length.
    return (
        (rng.randint(3, 40), 1),
        (rng.randint(1, 40), tree_size),
        (rng.randint(20, 60), tree_size),
        (0, tree_size + 4),
    )


def conformance_cases(
    backend_cls: type[AttentionBackend],
    *,
    dtypes: Sequence[str] | None = None,
    quick: bool = True,
) -> list[AttentionCase]:
    """The cases for ``backend_cls`` (``case.id`` makes a readable pytest id).

    ``quick`` (the default) is a handful of cases in which every axis value appears at least once
    (block sizes 16/32, head sizes 64/128/odd, GQA 1/4/8, each dtype, sliding window, soft-cap, fp8
    KV); ``quick=False`` is the product of block size x head size x GQA x dtype x feature variant.
    ``dtypes`` defaults to the backend's float32/bfloat16 support. Tree-kind backends get draft-tree
    cases. Unsupported combinations are still listed: running them skips with the reasons.
    """
    dtypes = tuple(dtypes) if dtypes else _default_dtypes(backend_cls)
    head_sizes = [64, 128]
    odd = _odd_head_size(backend_cls)
    if odd is not None:
        head_sizes.append(odd)
    kind = backend_cls.kind
    features = _FEATURES
    if kind == "tree":  # a window is not defined together with a tree mask
        features = tuple(f for f in _FEATURES if f[0] is None)
    cases: list[AttentionCase] = []
    if quick:
        combos = [
            (64, 1, 16, features[0]),
            (128, 4, 32, features[1 % len(features)]),
            (head_sizes[-1], 8, 16, features[2 % len(features)]),
            (64, 4, 32, features[3 % len(features)]),
            (128, 8, 16, features[4 % len(features)]),
            (head_sizes[-1], 1, 32, features[5 % len(features)]),
        ]
        # dtypes cycle, so each one meets several feature variants.
        items = [(c, dtypes[i % len(dtypes)]) for i, c in enumerate(combos)]
    else:
        items = [
            ((hs, g, bs, f), dt)
            for bs, hs, g, dt, f in itertools.product(
                (16, 32), head_sizes, GQA_SHAPES_KEYS, dtypes, features
            )
        ]
    for seed, ((hs, gqa, bs, (sw, cap, kv)), dt) in enumerate(items):
        h, hkv = GQA_SHAPES[gqa]
        case = AttentionCase(
            head_size=hs,
            num_heads=h,
            num_kv_heads=hkv,
            dtype=dt,
            block_size=bs,
            kv_cache_dtype=kv,
            sliding_window=sw,
            logits_soft_cap=cap,
            kind=kind,
            seed=seed,
        )
        if kind == "tree":
            size = 3 + seed % 4
            case = replace(case, tree_size=size, requests=_tree_requests(random.Random(seed), size))
        cases.append(case)
    return cases


# -------------------------------------------------------------------------------------- running
class _LayerState:
    """The layer attributes an implementation may read (see ``AttentionLayerState``)."""

    def __init__(self, device: torch.device, fp8: bool) -> None:
        self.k_scale = torch.tensor(K_SCALE if fp8 else 1.0, dtype=torch.float32, device=device)
        self.v_scale = torch.tensor(V_SCALE if fp8 else 1.0, dtype=torch.float32, device=device)


def random_tree_mask(size: int, generator: torch.Generator) -> torch.Tensor:
    """bool [size, size]: a random draft tree (node 0 the root; each node sees its ancestors and
    itself). Nodes are in topological order, as a proposer emits them."""
    mask = torch.eye(size, dtype=torch.bool)
    for i in range(1, size):
        parent = int(torch.randint(0, i, (1,), generator=generator))
        mask[i] |= mask[parent]
    return mask


class _Runner:
    """One backend's view of the case: its own cache, builder and implementation."""

    def __init__(
        self,
        backend_cls: type[AttentionBackend],
        case: AttentionCase,
        req: AttentionRequirements,
        num_blocks: int,
        device: torch.device,
        garbage: torch.Tensor,
    ) -> None:
        self.builder = backend_cls.get_builder_cls()(req, device)
        self.impl = backend_cls.get_impl_cls()(
            case.num_heads,
            case.head_size,
            case.head_size**-0.5,
            case.num_kv_heads,
            sliding_window=case.sliding_window,
            kv_cache_dtype=case.kv_cache_dtype,
            logits_soft_cap=case.logits_soft_cap,
        )
        shape = backend_cls.get_kv_cache_shape(
            num_blocks, case.block_size, case.num_kv_heads, case.head_size, case.kv_cache_dtype
        )
        cache_dtype = backend_cls.kv_cache_torch_dtype(case.torch_dtype, case.kv_cache_dtype)
        self.layer = _LayerState(device, case.kv_cache_dtype != "auto")
        fmt = packed_format(case.kv_cache_dtype)
        # Packed rows hold scales: raw garbage bytes would be NaN scales, which no engine cache
        # holds (it starts zeroed, then holds written rows); fill with garbage rows instead.
        values = (*shape[:-1], case.head_size) if fmt else shape
        n = 1
        for s in values:
            n *= s
        flat = garbage.repeat(-(-n // garbage.numel()))[:n].view(values)
        if fmt is not None:
            flat = fmt.encode(flat, self.layer.k_scale.cpu())
        self.kv_cache = flat.to(device=device, dtype=cache_dtype)

    def step(self, common: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.builder.build(common)
        return self.impl.forward(self.layer, q, k, v, self.kv_cache, meta)


def _compare(
    out: torch.Tensor, ref: torch.Tensor, case: AttentionCase, label: str
) -> tuple[float, list[str]]:
    if out.shape != ref.shape:
        return float("inf"), [f"{label}: output shape {tuple(out.shape)} != {tuple(ref.shape)}"]
    if out.dtype != ref.dtype:
        return float("inf"), [f"{label}: output dtype {out.dtype} != query dtype {ref.dtype}"]
    atol, rtol = TOLERANCES[case.dtype]
    if case.kv_cache_dtype != "auto":
        atol += FP8_EXTRA_ATOL
    o, r = out.float().cpu(), ref.float().cpu()
    err = (o - r).abs()
    max_err = float(err.nan_to_num(nan=float("inf")).max()) if err.numel() else 0.0
    bad = ~(err <= atol + rtol * r.abs())  # NaN counts as bad
    if not bool(bad.any()):
        return max_err, []
    tok, head, dim = (int(x) for x in bad.nonzero()[0])
    return max_err, [
        f"{label}: {int(bad.sum())} of {bad.numel()} values off (atol={atol}, rtol={rtol}); "
        f"max |err|={max_err:.3g}; first at token {tok}, head {head}, dim {dim}: "
        f"{float(o[tok, head, dim]):.5g} vs reference {float(r[tok, head, dim]):.5g}"
    ]


def run_attention_case(
    backend_cls: type[AttentionBackend],
    case: AttentionCase,
    *,
    device: torch.device | str = "cpu",
    platform: Platform | None = None,
) -> CaseResult:
    """Run one case (see the module docstring). ``platform`` defaults to the current platform and
    is only used for ``validate`` (availability and device capability)."""
    from llmhal.attention.reference import ReferenceAttentionBackend

    if platform is None:
        from llmhal.platforms import get_current_platform

        platform = get_current_platform()
    req = case.requirements(platform)
    reasons = backend_cls.validate(req, platform)
    if reasons:
        return CaseResult(case, skipped=tuple(reasons))
    device = torch.device(device)
    dtype = case.torch_dtype
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    hs, h, hkv, bs = case.head_size, case.num_heads, case.num_kv_heads, case.block_size

    # Shuffled physical blocks plus spare ones that no request owns.
    need = [-(-(ctx + q) // bs) for ctx, q in case.requests]
    num_blocks = sum(need) + 3
    perm = rng.sample(range(num_blocks), num_blocks)
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n

    # Every token of every request: q/k/v for positions 0..ctx+q-1.
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    seqs = [
        (rand(c + q, h, hs), rand(c + q, hkv, hs), rand(c + q, hkv, hs)) for c, q in case.requests
    ]
    garbage = rand(4096) * 50
    tree_mask = random_tree_mask(case.tree_size, gen) if case.tree_size else None

    try:
        runners = [
            _Runner(cls, case, req, num_blocks, device, garbage)
            for cls in (backend_cls, ReferenceAttentionBackend)
        ]
    except Exception as e:  # get_impl_cls()/get_builder_cls() or the cache shape: name the step
        return CaseResult(
            case,
            max_abs_err=float("inf"),
            failures=(
                f"building the implementation, metadata builder and KV cache raised "
                f"{type(e).__name__}: {e}",
            ),
        )

    def gather(idx: list[int], lo: list[int], hi: list[int]) -> list[torch.Tensor]:
        return [
            torch.cat([seqs[i][t][lo[j] : hi[j]] for j, i in enumerate(idx)]).to(device, dtype)
            for t in range(3)
        ]

    failures: list[str] = []
    max_err = 0.0
    # Step 1: prefill the cached contexts (single-token contexts are decodes and come first).
    ctx_reqs = [i for i, (c, _) in enumerate(case.requests) if c > 0]
    ctx_reqs.sort(key=lambda i: case.requests[i][0] != 1)
    steps = []
    if ctx_reqs:
        lens = [case.requests[i][0] for i in ctx_reqs]
        common = build_common_metadata(
            lens, [0] * len(ctx_reqs), [tables[i] for i in ctx_reqs], bs, device
        )
        steps.append(("context prefill", common, gather(ctx_reqs, [0] * len(lens), lens)))
    # Step 2: the mixed step (the case lists requests already ordered decodes first).
    idx = list(range(len(case.requests)))
    ctxs = [c for c, _ in case.requests]
    ends = [c + q for c, q in case.requests]
    common = build_common_metadata(
        [q for _, q in case.requests], ctxs, tables, bs, device, tree_mask=tree_mask
    )
    steps.append(("mixed step", common, gather(idx, ctxs, ends)))

    for label, common, (q, k, v) in steps:
        try:
            out = runners[0].step(common, q, k, v)
        except Exception as e:  # a crash is a failure of this case, with its message
            failures.append(f"{label}: {type(e).__name__}: {e}")
            break
        ref = runners[1].step(common, q, k, v)
        err, bad = _compare(out, ref, case, label)
        max_err = max(max_err, err)
        failures += bad
    return CaseResult(case, max_abs_err=max_err, failures=tuple(failures))


def check_attention_case(
    backend_cls: type[AttentionBackend],
    case: AttentionCase,
    *,
    device: torch.device | str = "cpu",
    platform: Platform | None = None,
) -> CaseResult:
    """pytest helper: run ``case``; skip with the backend's reasons, or fail with the details."""
    import pytest

    result = run_attention_case(backend_cls, case, device=device, platform=platform)
    if result.skipped:
        pytest.skip(f"{backend_cls.name} does not support {case.id}: " + "; ".join(result.skipped))
    if result.failures:
        pytest.fail(f"{backend_cls.name} {case.id}:\n  " + "\n  ".join(result.failures))
    return result


def run_attention_conformance(
    backend_cls: type[AttentionBackend],
    *,
    device: torch.device | str = "cpu",
    dtypes: Sequence[str] | None = None,
    quick: bool = True,
    platform: Platform | None = None,
    cases: Sequence[AttentionCase] | None = None,
) -> ConformanceReport:
    """Run every case of :func:`conformance_cases` (or ``cases``) and report; see
    :meth:`ConformanceReport.raise_on_failure`."""
    if cases is None:
        cases = conformance_cases(backend_cls, dtypes=dtypes, quick=quick)
    results = tuple(
        run_attention_case(backend_cls, c, device=device, platform=platform) for c in cases
    )
    return ConformanceReport(backend_cls.name, results)
