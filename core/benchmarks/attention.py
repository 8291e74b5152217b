"""``llmhal bench attention``: paged attention backends against SDPA on the same data, in one run.

For each dtype, mode (decode, prefill), batch size and context length, the benchmark builds one
random step, lays its keys and values out twice -- in each backend's paged KV cache (blocks in
shuffled order by default, as a long-running server's allocator leaves them) and contiguously for
``torch.nn.functional.scaled_dot_product_attention`` -- and times one attention call of each,
interleaved, reporting the median per call and the ratio to SDPA measured in the same run. Caches
are flushed before every timed call (``--flush-mb``): in a model, each layer reads its own KV cache,
so no call finds its data already cached.

* decode: every request has ``context - 1`` cached tokens and one new token;
* prefill: every request has ``context`` new tokens and nothing cached (causal).

Backends are looked up in the attention registry and validated on the current platform, then run
through their own builder, implementation and KV-cache shape: the path the engine takes. A backend
call includes writing the step's new keys/values into its cache, as in the engine. The SDPA
baseline is the faster of two formulations (``enable_gqa=True``, and for decode the query heads of
a KV head stacked as query rows). Outputs are checked against SDPA; the largest difference is shown.

Run ``python -m llmhal.benchmarks.attention --help`` (or ``llmhal bench attention --help``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from llmhal.attention import kv_formats, paged_kv
from llmhal.attention.backend import KV_CACHE_DTYPES, AttentionBackend, AttentionRequirements
from llmhal.attention.batch import build_common_metadata


@dataclass(frozen=True)
class Row:
    """One measured configuration of one backend (times in milliseconds per call)."""

    mode: str
    dtype: str
    batch: int
    context: int
    backend: str
    ms: float | None
    sdpa_ms: float | None
    ratio: float | None
    sdpa_variant: str
    max_abs_diff: float | None
    note: str = ""


class _LayerState:
    """The layer attributes an implementation reads: fp8 KV scales (1.0: plain values)."""

    def __init__(self) -> None:
        self.k_scale = torch.tensor(1.0)
        self.v_scale = torch.tensor(1.0)


@functools.cache
def _flush_buffer(mib: int) -> torch.Tensor:
    buf = torch.empty(mib << 18)  # float32: 4 bytes
    buf.fill_(0)  # fault its pages in now, not inside the first timed calls
    return buf


def _timed(
    fn: Callable[[], Any],
    times: list[float],
    clock: Callable[[], float],
    flush: torch.Tensor | None,
) -> Callable[[], None]:
    def run() -> None:
        if flush is not None:
            flush.fill_(len(times))  # evict the caches: no contender reuses another's data
        t = clock()
        fn()
        times.append((clock() - t) * 1e3)

    return run


def _resolve(name: str, req: AttentionRequirements) -> tuple[type[AttentionBackend] | None, str]:
    """The backend class through the registry, or None and why it cannot run here."""
    from llmhal.attention.registry import get_backend_entry, load_backend_class
    from llmhal.attention.selector import backend_reasons
    from llmhal.platforms import get_current_platform

    entry = get_backend_entry(name)
    if entry is None:
        return None, "not registered"
    reasons = backend_reasons(entry, req, get_current_platform())
    if reasons:
        return None, "; ".join(reasons)
    return load_backend_class(entry), ""


class _Case:
    """One step's data: contiguous tensors for SDPA, and the paged description for backends."""

    def __init__(self, a: argparse.Namespace, dtype: torch.dtype, mode: str, b: int, L: int):
        g = torch.Generator().manual_seed(a.seed)
        h, hkv, d, bs = a.num_heads, a.num_kv_heads, a.head_size, a.block_size
        self.dtype, self.mode, self.batch, self.context = dtype, mode, b, L
        self.k = torch.randn(b, hkv, L, d, generator=g).to(dtype)
        self.v = torch.randn(b, hkv, L, d, generator=g).to(dtype)
        new = 1 if mode == "decode" else L
        self.q = torch.randn(b, h, new, d, generator=g).to(dtype)
        nblk = -(-L // bs)
        self.num_blocks = b * nblk + 1
        order = torch.arange(b * nblk)
        if a.block_order == "shuffled":
            order = order[torch.randperm(b * nblk, generator=g)]
        self.tables = order.view(b, nblk).tolist()
        self.common = build_common_metadata([new] * b, [L - new] * b, self.tables, bs)
        self.scale = d**-0.5

    def flat_new(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's query/key/value as the engine passes them: [tokens, heads, head_size]."""
        new = self.q.shape[2]
        q = self.q.transpose(1, 2).reshape(-1, self.q.shape[1], self.q.shape[3])
        k = self.k[:, :, -new:].transpose(1, 2).reshape(-1, self.k.shape[1], self.k.shape[3])
        v = self.v[:, :, -new:].transpose(1, 2).reshape(-1, self.v.shape[1], self.v.shape[3])
        return q.contiguous(), k.contiguous(), v.contiguous()

    def sdpa_variants(self) -> dict[str, Callable[[], torch.Tensor]]:
        q, k, v = self.q, self.k, self.v
        b, h, new, d = q.shape
        hkv = k.shape[1]
        causal = self.mode == "prefill"
        out: dict[str, Callable[[], torch.Tensor]] = {
            "enable_gqa": lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=self.scale, enable_gqa=h != hkv
            )
        }
        if new == 1 and h != hkv:
            qg = q.reshape(b, hkv, h // hkv, d)
            out["grouped"] = lambda: F.scaled_dot_product_attention(
                qg, k, v, scale=self.scale
            ).reshape(b, h, 1, d)
        return out


def _logical_view(cache: torch.Tensor, logical: tuple[int, ...]) -> torch.Tensor:
    """``cache`` seen as [2, num_blocks, block_size, num_kv_heads, head_size].

    The benchmark fills caches directly (prefilling 64 x 4096 tokens through a backend would take
    longer than the benchmark). A backend's own layout is assumed to be a permutation of these
    axes, recognised by their sizes; the output check against SDPA catches a wrong guess.
    """
    shape = tuple(cache.shape)
    if shape == logical:
        return cache
    if sorted(shape) != sorted(logical) or len(set(logical)) != len(logical):
        raise RuntimeError(
            f"cannot fill a KV cache of shape {shape}: not a permutation of the axes {logical} "
            "(choose sizes that differ, e.g. another --block-size)"
        )
    return cache.permute(*[shape.index(n) for n in logical])


def _backend_call(
    cls: type[AttentionBackend], req: AttentionRequirements, c: _Case
) -> Callable[[], torch.Tensor]:
    """A zero-argument call of the backend's forward on a filled cache (its cost is what we time)."""
    h, d, hkv = req.num_heads, req.head_size, req.num_kv_heads
    shape = cls.get_kv_cache_shape(c.num_blocks, req.block_size, hkv, d, req.kv_cache_dtype)
    cache_dtype = cls.kv_cache_torch_dtype(c.dtype, req.kv_cache_dtype)
    kv_cache = torch.zeros(shape, dtype=cache_dtype)
    layer = _LayerState()
    impl = cls.get_impl_cls()(h, d, c.scale, hkv, kv_cache_dtype=req.kv_cache_dtype)
    builder = cls.get_builder_cls()(req, torch.device("cpu"))
    ctx = c.context - c.q.shape[2]
    if ctx:
        row = kv_formats.row_size(req.kv_cache_dtype, d)  # a packed format's row holds scales
        cache = _logical_view(kv_cache, (2, c.num_blocks, req.block_size, hkv, row))
        bs = req.block_size
        pos = torch.arange(ctx)
        table = torch.tensor(c.tables)[:, pos // bs].flatten()
        off = (pos % bs).repeat(c.batch)
        for i, x in enumerate((c.k, c.v)):
            vals = x[:, :, :ctx].transpose(1, 2).reshape(-1, hkv, d)
            scale = layer.k_scale if i == 0 else layer.v_scale
            cache[i, table, off] = paged_kv.quantize_to_cache(vals, cache_dtype, scale)
    q, k, v = c.flat_new()
    meta = builder.build(c.common)
    return lambda: impl.forward(layer, q, k, v, kv_cache, meta)


def _run_config(a: argparse.Namespace, dtype: torch.dtype, mode: str, b: int, L: int) -> list[Row]:
    dt = str(dtype).removeprefix("torch.")
    req = AttentionRequirements(
        head_size=a.head_size,
        num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads,
        dtype=dtype,
        kv_cache_dtype=a.kv_cache_dtype,
        block_size=a.block_size,
    )
    if mode == "prefill" and b * L > a.max_prefill_tokens:
        note = f"skipped: {b * L} prefill tokens > --max-prefill-tokens {a.max_prefill_tokens}"
        return [Row(mode, dt, b, L, n, None, None, None, "", None, note) for n in a.backends]
    c = _Case(a, dtype, mode, b, L)
    calls: dict[str, Callable[[], torch.Tensor]] = {}
    notes: dict[str, str] = {}
    for name in a.backends:
        cls, why = _resolve(name, req)
        if cls is None:
            notes[name] = f"unavailable: {why}"
            continue
        try:
            calls[name] = _backend_call(cls, req, c)
        except Exception as e:  # a backend that cannot even set up is reported, not fatal
            notes[name] = f"failed: {type(e).__name__}: {e}"
    sdpa = c.sdpa_variants()
    times: dict[str, list[float]] = {k: [] for k in [*sdpa, *calls]}
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    flush = _flush_buffer(a.flush_mb) if a.flush_mb else None
    runs = {k: _timed(f, times[k], clock, flush) for k, f in [*sdpa.items(), *calls.items()]}
    outputs: dict[str, torch.Tensor] = {}
    for name, f in [*sdpa.items(), *calls.items()]:
        try:
            outputs[name] = f()  # warm-up, and the output checked below
            for _ in range(a.warmup - 1):
                f()
        except Exception as e:
            notes[name] = f"failed: {type(e).__name__}: {e}"
            runs.pop(name, None)
            calls.pop(name, None)
    for _ in range(a.repeats):  # interleaved, so load changes hit every contender alike
        for run in runs.values():
            run()
    med = {k: statistics.median(v) for k, v in times.items() if v}
    best = min(sdpa, key=lambda k: med.get(k, float("inf")))
    sdpa_ms = med.get(best)
    ref = outputs[best].float().transpose(1, 2).reshape(-1, a.num_heads, a.head_size)
    rows = []
    for name in a.backends:
        if name in calls and name in med:
            diff = float((outputs[name].float() - ref).abs().max())
            ratio = med[name] / sdpa_ms if sdpa_ms else None
            rows.append(Row(mode, dt, b, L, name, med[name], sdpa_ms, ratio, best, diff))
        else:
            rows.append(
                Row(mode, dt, b, L, name, None, sdpa_ms, None, best, None, notes.get(name, ""))
            )
    return rows


def _machine() -> dict[str, Any]:
    from llmhal.platforms import get_current_platform

    platform = get_current_platform()
    return {
        "platform": platform.name,
        "device": platform.get_device_name(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY", ""),
    }


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: list[Row]) -> str:
    head = f"{'mode':8} {'dtype':9} {'batch':>5} {'ctx':>5} {'backend':15} {'ms/call':>9} {'sdpa ms':>9} {'ratio':>6} {'max|diff|':>9}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.mode:8} {r.dtype:9} {r.batch:>5} {r.context:>5} {r.backend:15} "
            f"{_fmt(r.ms, '9.3f')} {_fmt(r.sdpa_ms, '9.3f')} {_fmt(r.ratio, '6.2f')} "
            f"{_fmt(r.max_abs_diff, '9.2e')}  {r.note or ('sdpa=' + r.sdpa_variant)}"
        )
    return "\n".join(lines)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="llmhal bench attention",
        description="Paged attention backends vs torch SDPA on contiguous data (time per call).",
    )
    p.add_argument("--backends", type=_names, default=["cpu_attn", "flex_attention"])
    p.add_argument("--modes", type=_names, default=["decode", "prefill"])
    p.add_argument("--dtypes", type=_names, default=["float32", "bfloat16"])
    p.add_argument("--batch", type=_ints, default=[1, 16, 64], help="batch sizes, e.g. 1,16,64")
    p.add_argument("--context", type=_ints, default=[512, 4096], help="context lengths")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    p.add_argument("--block-order", default="shuffled", choices=["shuffled", "sequential"])
    p.add_argument("--repeats", type=int, default=7, help="timed calls per contender (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=16384,
        help="skip prefill configurations with more new tokens than this (they take minutes)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--flush-mb",
        type=int,
        default=128,
        help="MiB written before every timed call so each starts with cold caches, as one layer "
        "of a real model does (0: keep caches warm; contenders sharing data then favour each other)",
    )
    p.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="wall time, or process CPU time (steadier on a busy machine; use with --threads 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    a = p.parse_args(argv)
    if a.num_heads % a.num_kv_heads:
        p.error("--num-heads must be a multiple of --num-kv-heads")
    bad = [m for m in a.modes if m not in ("decode", "prefill")]
    if bad:
        p.error(f"unknown mode(s) {bad}; valid: decode, prefill")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.threads:
        torch.set_num_threads(a.threads)
    machine = _machine()
    print(
        f"{machine['device']} | torch {machine['torch']}, {machine['torch_threads']} threads, "
        f"{machine['cpu_capability']}, {a.clock} clock | heads {a.num_heads}/{a.num_kv_heads} (q/kv), head size "
        f"{a.head_size}, block size {a.block_size}, kv cache {a.kv_cache_dtype}, "
        f"{a.block_order} blocks"
    )
    rows: list[Row] = []
    for dtype_name in a.dtypes:
        dtype = getattr(torch, dtype_name)
        table: list[Row] = []
        for mode in a.modes:
            for L in a.context:
                for b in a.batch:
                    table += _run_config(a, dtype, mode, b, L)
        print()
        print(format_table(table), flush=True)
        rows += table
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"machine": machine, "args": vars(a), "rows": [asdict(r) for r in rows]},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
