"""``llmhal bench quant_kernels``: GGUF matmuls on SmolLM2-135M's shapes, kernel against kernel.

For each weight shape ``(N, K)`` of SmolLM2-135M as the gguf method builds its kernels (q/k/v
joined 960x576, o 576x576, gate/up joined 3072x576, down 576x1536, LM head 49152x576) and each
format (Q4_1, Q8_0 by default; the weights are random, quantized by the gguf package), it times one
call ``y = x @ W.T`` at M tokens of:

* ``kernel``: the active platform's ``quant_linear`` kernel on the exact grouped form (what the gguf
  method runs by default);
* each of the platform kernel's own paths, when its class lists them in an optional
  ``benchmark_variants()`` classmethod (name -> constructor taking ``(weight, act_dtype)``);
* ``native``: core's :class:`~llmhal.ops.quant_linear.NativeQuantLinear` (dequantize per call, fp32);
* ``dequant``: the raw GGUF blocks dequantized in row chunks (``LLMHAL_GGUF_KERNEL=dequant``);
* ``fp32`` / ``bf16``: a dense ``F.linear`` with the dequantized weight in that dtype.

Reported per shape: weight bytes held, the fastest of ``--rounds`` rounds of mean time per call
(the machine may be shared), and the relative error against float64 at the largest M. The same
weight is reused call after call, so it stays in cache, which flatters large formats (dense fp32).
Then one whole decode step (30 layers x 4 matmuls + the LM head in Q8_0, M=1), every matmul with its
own weight, run in sequence so the weights stream from memory as they do when the engine decodes.

Each table is printed once per thread count (``--threads 2,1``).

    python -m llmhal.benchmarks.quant_kernels [--formats Q4_1,Q8_0] [--tokens 1,16,64,512] [--avx2]

``--avx2`` re-runs the benchmark with ``ATEN_CPU_CAPABILITY=avx2`` (torch's kernels limited to AVX2);
``--env NAME=VALUE`` re-runs it with any variable set (e.g. a platform's kernel build flags).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = {  # (N, K) -> matmuls of that shape in one decode step of SmolLM2-135M (30 layers)
    (960, 576): 30,  # q, k, v joined (one kernel per layer: consecutive shards of one type)
    (576, 576): 30,  # o
    (3072, 576): 30,  # gate, up joined
    (576, 1536): 30,  # down
    (49152, 576): 1,  # LM head (tied embedding)
}
HEAD = (49152, 576)
HEAD_FORMAT = "Q8_0"  # the default model file's tied embedding, whatever --formats says
BASE_VARIANTS = ("kernel", "native", "dequant", "fp32", "bf16")


def _platform_variants() -> dict[str, Callable[..., Any]]:
    """The platform kernel's own paths (its optional ``benchmark_variants()``), by name."""
    from llmhal.ops.registry import get_op

    listed = getattr(get_op("quant_linear"), "benchmark_variants", None)
    return dict(listed()) if listed is not None else {}


def _variants() -> list[str]:
    return [BASE_VARIANTS[0], *_platform_variants(), *BASE_VARIANTS[1:]]


def _time_us(fn: Callable[[], Any], rounds: int, min_seconds: float = 0.05) -> float:
    """Fastest round's mean microseconds per call (rounds of at least ``min_seconds``)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        n, start = 0, time.perf_counter()
        while n < 2 or time.perf_counter() - start < min_seconds:
            fn()
            n += 1
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


def _build(variant: str, fmt: str, raw: torch.Tensor, k: int) -> tuple[Any, int, str]:
    """(callable(x), weight bytes, implementation name) of one contender, with its own storage."""
    from llmhal.ops.quant_linear import NativeQuantLinear
    from llmhal.quantization.gguf_dequant import GGUFRawWeight, dequantize, to_grouped
    from llmhal.quantization.grouped_linear import make_kernel

    extra = _platform_variants()
    if variant in ("kernel", "native") or variant in extra:
        grouped = to_grouped(raw, fmt)
        if variant == "kernel":
            kernel = make_kernel(grouped, torch.float32)
        elif variant == "native":
            kernel = NativeQuantLinear(grouped, torch.float32)
        else:
            kernel = extra[variant](grouped, torch.float32)
        return kernel, kernel.weight_bytes(), kernel.name
    if variant == "dequant":
        rows = GGUFRawWeight(raw.clone(), fmt, k)
        return rows, rows.weight_bytes(), rows.name
    w = dequantize(raw, fmt).to(torch.float32 if variant == "fp32" else torch.bfloat16)
    if variant == "fp32":
        return (lambda x: F.linear(x, w)), w.numel() * 4, "F.linear fp32"
    return (lambda x: F.linear(x.bfloat16(), w)), w.numel() * 2, "F.linear bf16"


def _weights(fmt: str) -> dict[tuple[int, int], torch.Tensor]:
    from llmhal.quantization.gguf_dequant import ggml_type
    from llmhal.testing.gguf_files import quantized_rows

    out = {}
    for n, k in SHAPES:
        if k % ggml_type(fmt).block_size:
            print(f"{fmt}: {n}x{k} skipped (K is not a multiple of its {ggml_type(fmt).block_size}-weight blocks)")  # fmt: skip
            continue
        out[(n, k)] = quantized_rows(fmt, n, k, seed=n + k)
    return out


def run(formats: list[str], tokens: list[int], rounds: int) -> list[dict[str, Any]]:
    """Per shape: every contender on the same (cache-warm) weight."""
    from llmhal.quantization.gguf_dequant import dequantize

    rows = []
    gen = torch.Generator().manual_seed(0)
    for fmt in formats:
        for (n, k), raw in _weights(fmt).items():
            ref_w = dequantize(raw, fmt).double()
            xs = {m: torch.randn(m, k, generator=gen) for m in tokens}
            for variant in _variants():
                fn, nbytes, impl = _build(variant, fmt, raw, k)
                times = {m: _time_us(lambda fn=fn, x=xs[m]: fn(x), rounds) for m in tokens}
                x = xs[tokens[-1]]
                ref = x.double() @ ref_w.T
                err = float((fn(x).double() - ref).norm() / ref.norm())
                rows.append(dict(format=fmt, n=n, k=k, count=SHAPES[(n, k)], variant=variant, impl=impl, bytes=nbytes, us=times, err=err))  # fmt: skip
    return rows


def decode_step(fmt: str, rounds: int) -> dict[str, tuple[float, int]]:
    """variant -> (ms, bytes) of all of one decode step's matmuls (M=1), each with its own weight,
    run in sequence: the weights stream from memory as in a real step (the per-shape timings
    reuse one weight, which stays in cache). The layers are in ``fmt``, the LM head in
    ``HEAD_FORMAT`` (as in the default model file)."""
    from llmhal.testing.gguf_files import quantized_rows

    out = {}
    weights = _weights(fmt)
    weights[HEAD] = quantized_rows(HEAD_FORMAT, *HEAD, seed=sum(HEAD))
    for variant in _variants():
        calls = []
        for (n, k), raw in weights.items():
            x = torch.randn(1, k)
            for _ in range(SHAPES[(n, k)]):
                fn, nbytes, _ = _build(variant, HEAD_FORMAT if (n, k) == HEAD else fmt, raw, k)
                calls.append((fn, x, nbytes))

        def step(calls=calls) -> None:
            for fn, x, _ in calls:
                fn(x)

        out[variant] = (_time_us(step, rounds, min_seconds=0.0) / 1e3, sum(c[2] for c in calls))
        del calls
    return out


def _print(rows: list[dict[str, Any]], tokens: list[int]) -> None:
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}")  # fmt: skip
    head = f"{'format':6} {'N x K':>11} {'variant':13} {'impl':20} {'MiB':>8}"
    head += "".join(f" {f'M={m} us':>11}" for m in tokens) + f" {'rel.err':>9}"
    print(head)
    for r in rows:
        line = f"{r['format']:6} {r['n']:>5}x{r['k']:<5} {r['variant']:13} {r['impl'][:20]:20} {r['bytes'] / 2**20:8.2f}"  # fmt: skip
        line += "".join(f" {r['us'][m]:11.1f}" for m in tokens) + f" {r['err']:9.2e}"
        print(line)


def _print_steps(steps: dict[str, dict[str, tuple[float, int]]]) -> None:
    calls = sum(SHAPES.values())
    print(
        f"\nOne SmolLM2-135M decode step, M=1 ({calls} matmuls, each weight distinct; LM head "
        f"{HEAD_FORMAT}), threads {torch.get_num_threads()}: ms and weight MiB"
    )
    for fmt, res in steps.items():
        for v, (ms, b) in res.items():
            print(f"  layers {fmt:6} {v:13} {ms:8.2f} ms {b / 2**20:7.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="llmhal bench quant_kernels", description=__doc__.split("\n")[0]
    )
    p.add_argument("--formats", default="Q4_1,Q8_0", help="GGUF types, comma-separated")
    p.add_argument("--tokens", default="1,16,64,512", help="M values (tokens per call)")
    p.add_argument("--rounds", type=int, default=5, help="timing rounds (the fastest is kept)")
    p.add_argument("--avx2", action="store_true", help="re-run with ATEN_CPU_CAPABILITY=avx2")
    p.add_argument(
        "--threads", default="2,1", help="torch thread counts, one table each (0: torch's default)"
    )
    p.add_argument("--env", action="append", default=[], help="re-run with NAME=VALUE set")
    p.add_argument("--shapes", default="", help="only these N x K, e.g. 576x576,49152x576")
    p.add_argument("--no-shapes", action="store_true", help="skip the per-shape table")
    p.add_argument("--no-step", action="store_true", help="skip the whole decode step")
    a = p.parse_args(argv)
    if a.avx2 or a.env:
        args, skip = [], False
        for arg in argv if argv is not None else sys.argv[1:]:
            if skip or arg == "--avx2" or arg.startswith("--env="):
                skip = False
                continue
            skip = arg == "--env"
            if not skip:
                args.append(arg)
        env = dict(os.environ)
        if a.avx2:
            env["ATEN_CPU_CAPABILITY"] = "avx2"
        for item in a.env:
            name, sep, value = item.partition("=")
            if not sep:
                p.error(f"--env {item!r}: expected NAME=VALUE")
            env[name] = value
        cmd = [sys.executable, "-m", "llmhal.benchmarks.quant_kernels", *args]
        return subprocess.run(cmd, env=env).returncode
    if a.shapes:
        wanted = {tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")}
        for shape in set(SHAPES) - wanted:
            del SHAPES[shape]
    tokens = [int(t) for t in a.tokens.split(",")]
    formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    for threads in [int(t) for t in a.threads.split(",")]:
        if threads:
            torch.set_num_threads(threads)
        if not a.no_shapes:
            _print(run(formats, tokens, a.rounds), tokens)
        if not a.no_step and len(SHAPES) == 5:
            _print_steps({fmt: decode_step(fmt, a.rounds) for fmt in formats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
