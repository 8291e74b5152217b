"""``llmhal bench ssm``: a full-width Mamba-2 (and, when llmhal has it, the Bamba hybrid) against
transformers on the same weights, and llmhal's decode time per token as the context grows.

The checkpoints are tiny-random but full-width, built here with transformers' own classes
(default: 24 layers of width 768, Mamba-2 mixers of 24 heads x 64 with 128 state channels in one
group, conv width 4, 256-token SSD chunks; the hybrid has the same mixers with softmax attention
(12 heads over 4 KV heads of 64) in every sixth layer and a 2048-wide MLP after every mixer, as
Bamba does). The vocabulary is the tiny test tokenizer's (384 ids), so the LM head does not
dilute the layers' cost.

Each system runs in its own worker process and measures the same way: after an untimed warm-up,
a run of ``1 + --new-tokens`` tokens minus a run of 1 token (so prefill cancels), each the least
of ``--repeat`` runs, timed by this process's CPU time and by wall time. CPU time is the figure to
read on a shared host, where other work stretches wall time unevenly between the workers (it is
the compute time when the run has one thread: ``OMP_NUM_THREADS=1``); wall time is the one for a
quiet, multi-threaded run. The context rows are one request at a time in llmhal's worker: a
prompt of each context length, then ``--new-tokens`` decode steps (prefill excluded). A Mamba-2 model's state
is constant in size, so its time per token should not grow with the context; the hybrid's
attention layers read a KV cache that does.

``--dtype float32,bfloat16`` measures both systems in each dtype in turn, in the same run (both
load the weights in it; llmhal keeps the SSM state as ``--mamba-ssm-cache-dtype`` says, auto: the
model's dtype); the context rows are measured once, in bfloat16 when it is asked for.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SsmShape:
    hidden: int = 768
    layers: int = 24
    heads: int = 24  # Mamba-2 heads: heads * head_dim = expand * hidden
    head_dim: int = 64
    state: int = 128
    groups: int = 1
    conv: int = 4
    chunk: int = 256
    attn_every: int = 6  # hybrid: softmax attention in layers attn_every - 1, 2 * attn_every - 1...
    attn_heads: int = 12
    attn_kv_heads: int = 4
    mlp: int = 2048


def _configs(shape: SsmShape) -> dict[str, Any]:
    import transformers

    from llmhal.testing.tiny_models import TINY_VOCAB

    expand, rest = divmod(shape.heads * shape.head_dim, shape.hidden)
    if rest or not expand:
        raise SystemExit(
            f"heads x head_dim ({shape.heads} x {shape.head_dim}) must be a multiple of hidden "
            f"({shape.hidden}): the mixers' inner width is expand x hidden"
        )
    # max_position_embeddings: Mamba-2 has no position limit, but the engine caps a config
    # without one at 2048; the context rows need 4096 and more.
    common = dict(vocab_size=TINY_VOCAB, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=0, pad_token_id=0,
                  max_position_embeddings=16384)  # fmt: skip
    attn = list(range(shape.attn_every - 1, shape.layers, shape.attn_every))
    return {
        "mamba2": transformers.Mamba2Config(
            num_heads=shape.heads, head_dim=shape.head_dim, expand=expand, state_size=shape.state,
            n_groups=shape.groups, conv_kernel=shape.conv, chunk_size=shape.chunk, **common,
        ),
        "hybrid": transformers.BambaConfig(
            mamba_n_heads=shape.heads, mamba_d_head=shape.head_dim, mamba_expand=expand,
            mamba_d_state=shape.state, mamba_n_groups=shape.groups, mamba_d_conv=shape.conv,
            mamba_chunk_size=shape.chunk, attn_layer_indices=attn,
            num_attention_heads=shape.attn_heads, num_key_value_heads=shape.attn_kv_heads,
            intermediate_size=shape.mlp, **common,
        ),
    }  # fmt: skip


def make_checkpoints(folder: Path, shape: SsmShape, names: list[str], seed: int = 0) -> dict:
    """Write the named checkpoints (``mamba2``, ``hybrid``) in float32 with the tiny tokenizer;
    reuses checkpoints already written for the same shape."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmhal.testing.tiny_models import TINY_VOCAB, make_tokenizer

    configs = _configs(shape)
    out = {}
    for name in names:
        target = folder / f"{name}-{shape.hidden}x{shape.layers}-h{shape.heads}-n{shape.state}"
        out[name] = target
        if (target / "model.safetensors").exists():
            continue
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(configs[name], dtype=torch.float32)
        model.save_pretrained(str(target), safe_serialization=True)
        make_tokenizer(TINY_VOCAB).save_pretrained(str(target))
        del model
    return out


def _timer() -> Callable[[], tuple[float, float]]:
    """A stopwatch of (CPU seconds of this process, wall seconds) since it was made."""
    c0, w0 = time.process_time(), time.perf_counter()
    return lambda: (time.process_time() - c0, time.perf_counter() - w0)


def _decode_rates(gen: Callable[[list[list[int]], int], None], vocab: int, a: Any) -> dict:
    """Decode tokens/s at each batch size, by CPU time and by wall time, measured the same way
    for both systems: a run of 1 + new_tokens tokens minus a run of 1 token (prefill and the
    first token cancel), each the least of ``repeat`` runs. Prompts have equal lengths."""
    gen(_prompts(vocab, max(a.batch_sizes), a.prompt_len), a.new_tokens)  # untimed warm-up
    out: dict[str, dict[str, float]] = {"decode": {}, "decode_cpu": {}}

    def best(prompts: list[list[int]], n: int) -> tuple[float, float]:
        runs = []
        for _ in range(max(1, a.repeat)):
            stop = _timer()
            gen(prompts, n)
            runs.append(stop())
        return min(r[0] for r in runs), min(r[1] for r in runs)

    for b in a.batch_sizes:
        prompts = _prompts(vocab, b, a.prompt_len)
        (c1, w1), (cn, wn) = best(prompts, 1), best(prompts, 1 + a.new_tokens)
        out["decode_cpu"][str(b)] = b * a.new_tokens / max(cn - c1, 1e-9)
        out["decode"][str(b)] = b * a.new_tokens / max(wn - w1, 1e-9)
    return out


def add_decode_args(p: argparse.ArgumentParser) -> None:
    """The options :func:`_decode_rates` reads, and ``--dtype`` (shared with ``bench moe``)."""
    p.add_argument(
        "--dtype",
        default="float32",
        help="float32, bfloat16, or both comma-separated (measured in turn in the same run); "
        "every system loads the weights in it",
    )
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2, help="timed runs per figure; the least counts")


def split_choices(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    """A comma-separated flag's items, each one of ``allowed`` (shared with ``bench moe``)."""
    items = [v.strip() for v in str(value).split(",") if v.strip()]
    if not items or any(v not in allowed for v in items):
        raise SystemExit(
            f"{flag} {value!r}: use {', '.join(allowed)}, or several comma-separated "
            f"(e.g. {flag} {','.join(allowed[:2])})"
        )
    return items


def _prompts(vocab: int, batch: int, length: int) -> list[list[int]]:
    rng = random.Random(batch * 7919 + length)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(batch)]


def _llmhal_worker(a: argparse.Namespace) -> dict[str, Any]:
    """llmhal: decode rates, then decode ms per token after a prompt of each context length
    (one request; the engine's decode clock for wall time, its decode steps' CPU time)."""
    from llmhal import LLM, SamplingParams
    from llmhal.attention.state import recurrent_layers

    contexts = [int(c) for c in a.contexts.split(",")] if a.contexts else []
    llm = LLM(a.model, dtype=a.dtype, max_num_seqs=max(a.batch_sizes),
              enable_prefix_caching=False, mamba_ssm_cache_dtype=a.mamba_ssm_cache_dtype,
              max_model_len=max([*contexts, a.prompt_len]) + a.new_tokens + 8)  # fmt: skip
    engine = llm.engine
    vocab = engine.config.model.hf_config.vocab_size

    def gen(prompts: list[list[int]], n: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    # The dtype the engine loaded the weights in, so the table cannot claim a precision it ran
    # without.
    specs = {
        s.name: s.dtype for m in recurrent_layers(engine.runner.model) for s in m.state_specs()
    }
    out: dict[str, Any] = {"attention": llm.load_report.attention_backends,
                           "dtype": str(engine.config.model.dtype).removeprefix("torch."),
                           "ssm_state": str(specs.get("ssm")).removeprefix("torch.")}  # fmt: skip
    out.update(_decode_rates(gen, vocab, a))
    step, decode_cpu = engine.step, [0.0]

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        stats = engine.stats
        c0, d0, p0 = time.process_time(), stats.decode_tokens, stats.prefill_tokens
        result = step(*args, **kwargs)
        if stats.decode_tokens > d0 and stats.prefill_tokens == p0:
            decode_cpu[0] += time.process_time() - c0
        return result

    engine.step = timed_step  # type: ignore[method-assign]

    def ms_per_token(length: int) -> tuple[float, float]:
        engine.stats.__init__()
        decode_cpu[0] = 0.0
        gen(_prompts(vocab, 1, length), a.new_tokens)
        return 1000.0 / engine.stats.decode_tps, 1000.0 * decode_cpu[0] / engine.stats.decode_tokens

    out["context"] = {}
    for c in contexts:
        runs = [ms_per_token(c) for _ in range(max(1, a.repeat))]
        out["context"][str(c)] = min(r[0] for r in runs)
        out["context"][f"cpu_{c}"] = min(r[1] for r in runs)
    return out


def _hf_worker(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    # A benchmarked checkpoint's own Python code never runs (docs/security.md).
    dtype = getattr(torch, a.dtype)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, trust_remote_code=False)
    model.eval()

    def gen(prompts: list[list[int]], n: int) -> None:
        x = torch.tensor(prompts)
        with torch.inference_mode():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip

    weights = str(next(model.parameters()).dtype).removeprefix("torch.")
    return {"dtype": weights, **_decode_rates(gen, model.config.vocab_size, a)}


def run_system(
    system: str,
    model: Path,
    a: argparse.Namespace,
    contexts: str = "",
    dtype: str = "float32",
    ssm_state: str = "auto",
) -> dict:
    """Measure ``model`` with ``system`` ("llmhal" or "hf") loaded in ``dtype`` in a fresh
    worker process (llmhal keeping its SSM state in ``ssm_state``, mamba_ssm_cache_dtype)."""
    cmd = [sys.executable, "-m", "llmhal.benchmarks.ssm", "--worker", system, "--model",
           str(model), "--dtype", dtype, "--mamba-ssm-cache-dtype", ssm_state,
           "--batch-sizes", ",".join(map(str, a.batch_sizes)),
           "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens), "--repeat",
           str(a.repeat), "--contexts", contexts]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{system} worker failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _row(name: str, values: list[str]) -> str:
    return f"{name:<30}" + "".join(f"{v:>12}" for v in values)


def _fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{unit}" if x < 100 else f"{x:.0f}{unit}"


def report(
    results: dict[str, dict[str, Any]], batch_sizes: list[int], contexts: list[int], dtype: str = ""
) -> str:
    """One dtype's table: decode tok/s of both systems, then llmhal's context rows if measured."""
    lines = []
    at = f" {dtype}" if dtype else ""
    for key, clock in (("decode_cpu", "CPU time"), ("decode", "wall time")):
        lines += [_row(f"decode tok/s{at} ({clock})", [f"batch {b}" for b in batch_sizes])]
        for model, variant in [(k.split(" ")[0], k) for k in results if not k.startswith("hf_")]:
            ours, theirs = results[variant], results.get(f"hf_{model}")
            ours_tps = [float(ours[key][str(b)]) for b in batch_sizes]
            lines.append(_row(f"llmhal {variant}", [_fmt(v) for v in ours_tps]))
            if theirs is not None:
                theirs_tps = [float(theirs[key][str(b)]) for b in batch_sizes]
                lines.append(_row(f"transformers {model}", [_fmt(v) for v in theirs_tps]))
                lines.append(_row("  llmhal / transformers", [
                    _fmt(o / t if t else None, "x")
                    for o, t in zip(ours_tps, theirs_tps, strict=True)
                ]))  # fmt: skip
        lines.append("")
    has_ctx = any((results.get(m) or {}).get("context") for m in ("mamba2", "hybrid"))
    if contexts and has_ctx:
        heads = [f"ctx {c}" for c in contexts] + ["last/first"]
        lines.append(_row(f"llmhal decode ms/token{at}", heads))
        for model in ("mamba2", "hybrid"):
            ctx = (results.get(model) or {}).get("context") or {}
            for clock, prefix in (("CPU", "cpu_"), ("wall", "")):
                if f"{prefix}{contexts[0]}" not in ctx:
                    continue
                ms = [float(ctx[f"{prefix}{c}"]) for c in contexts]
                label = f"{model} ({clock})"
                lines.append(_row(label, [_fmt(v) for v in ms] + [_fmt(ms[-1] / ms[0], "x")]))
    return "\n".join(lines).rstrip("\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="llmhal bench ssm", description=__doc__.split("\n\n")[0])
    for field_name, default in SsmShape.__dataclass_fields__.items():
        p.add_argument("--" + field_name.replace("_", "-"), type=int, default=default.default)
    add_decode_args(p)
    p.add_argument(
        "--contexts", default="256,1024,4096", help="prompt lengths of the ms/token rows"
    )
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--no-hybrid", action="store_true", help="skip the Bamba hybrid")
    p.add_argument("--no-contexts", action="store_true", help="skip the context rows")
    p.add_argument(
        "--workdir", help="keep the generated checkpoints here (reused when the shape matches)"
    )
    p.add_argument(
        "--mamba-ssm-cache-dtype",
        default="auto",
        help="llmhal's SSM state: auto (the model dtype, vLLM's default), float32, bfloat16, or "
        "several comma-separated, each measured against the same transformers baseline",
    )
    p.add_argument("--json", dest="json_path", help="also write the results here")
    p.add_argument("--worker", choices=["llmhal", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.batch_sizes = [int(x) for x in str(a.batch_sizes).split(",")]
    dtypes = split_choices(a.dtype, ("float32", "bfloat16"), "--dtype")
    ssm_states = split_choices(
        a.mamba_ssm_cache_dtype, ("auto", "float32", "bfloat16"), "--mamba-ssm-cache-dtype"
    )
    if a.worker:
        result = _llmhal_worker(a) if a.worker == "llmhal" else _hf_worker(a)
        print(json.dumps(result))
        return 0
    from llmhal.models.registry import ModelRegistry

    contexts = [] if a.no_contexts else [int(c) for c in a.contexts.split(",")]
    shape = SsmShape(**{f: getattr(a, f) for f in SsmShape.__dataclass_fields__})
    names = ["mamba2"]
    if not a.no_hybrid and ModelRegistry.is_registered("BambaForCausalLM"):
        names.append("hybrid")
    if a.workdir:
        folder = Path(a.workdir)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    else:
        folder = Path(tempfile.mkdtemp(prefix="llmhal_bench_ssm_"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    ckpt = make_checkpoints(folder, shape, names)
    # The context rows are measured once, in bfloat16 when it is asked for (the precision
    # dtype=auto picks on a CPU with native bf16), else in the one dtype given.
    ctx_dtype = "bfloat16" if "bfloat16" in dtypes else dtypes[0]
    results: dict[str, dict[str, dict[str, Any]]] = {d: {} for d in dtypes}
    for dtype in dtypes:
        for name in names:
            ctx = ",".join(map(str, contexts)) if dtype == ctx_dtype else ""
            # The first state dtype under the model's name (it measures the context rows); the
            # others as "<model> ssm=<dtype>".
            jobs = {name: ("llmhal", ctx, ssm_states[0])}
            jobs.update({f"{name} ssm={st}": ("llmhal", "", st) for st in ssm_states[1:]})
            if not a.no_hf:
                jobs[f"hf_{name}"] = ("hf", "", "auto")
            for key, (system, c, st) in jobs.items():
                results[dtype][key] = run_system(system, ckpt[name], a, c, dtype, st)
                # Each figure as it comes: a long run that fails later keeps what it measured.
                print(f"{dtype} {key}: {json.dumps(results[dtype][key])}", file=sys.stderr,
                      flush=True)  # fmt: skip
    threads = os.environ.get("OMP_NUM_THREADS", "torch's default")
    print(f"shape: {shape}\nnew tokens: {a.new_tokens}  prompt: {a.prompt_len}"
          f"  threads: {threads}")  # fmt: skip
    for dtype in dtypes:
        print(report(results[dtype], a.batch_sizes, contexts, dtype) + "\n")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"shape": shape.__dict__, "results": results, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
