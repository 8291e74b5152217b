"""``llmhal bench moe``: MoE models (Mixtral-shaped and DeepSeek-V2-Lite-shaped) against
transformers, against a dense model with the same active parameters, and with ``experts_int8``,
in one run.

The checkpoints are tiny-random but realistically shaped, built here with transformers' own classes:

* ``mixtral`` (default shape): Mixtral's layout scaled to hidden 1024, 8 experts of width 2816,
  top-2, 16 layers, 8 query heads over 2 KV heads of 128. Its dense baseline is the same decoder
  with one MLP of width ``top_k * expert`` (a Mistral config).
* ``deepseek``: DeepSeek-V2-Lite's layout scaled down (6 layers of width 512, MLA with 8 heads,
  ``kv_lora_rank`` 256, nope/rope/value head sizes 64/32/64, no query LoRA; 16 routed experts of
  384 with top-4 and softmax routing, 2 shared experts, the first layer dense). Its dense baseline
  is the same DeepSeek-V2 config with every layer dense and of width ``(top_k + shared) * expert``.

Per token a dense baseline reads the same number of MLP weights as its MoE model's chosen experts,
so the ratio of their times per token says what routing, grouping and the extra experts cost. The
vocabulary is the tiny test tokenizer's (384 ids), so the LM head does not dilute that ratio. For
DeepSeek the table also gives MLA's KV-cache bytes per token against the same attention with
per-head keys and values (the formula: ``kv_lora_rank + qk_rope_head_dim`` values a layer against
``heads * (qk_nope + qk_rope + v_head)``).

With ``--llama-cpp PATH`` (llama.cpp's ``llama-batched-bench``, built by the user) the Mixtral
shape also runs in llama.cpp, on a GGUF file of the same weights in the same dtype
(:mod:`llmhal.benchmarks.llama_cpp`).

Every system runs in its own worker process and measures as ``llmhal bench ssm`` does: after an
untimed warm-up, a run of ``1 + --new-tokens`` tokens minus a run of 1 token (prefill cancels),
each the least of ``--repeat`` runs, timed by the process's CPU time and by wall time (CPU time is
the figure to read on a shared host: with ``OMP_NUM_THREADS=1`` it is the compute time, which
other work does not stretch); plus weight bytes and peak resident memory. ``--dtype float32,bfloat16`` measures every system in each dtype in turn,
in the same run (both systems load the weights in it).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from llmhal.benchmarks.engine import _peak_rss_mb
from llmhal.benchmarks.ssm import _decode_rates, add_decode_args, split_choices
from llmhal.benchmarks.ssm import _hf_worker as _ssm_hf_worker

FAMILIES = ("mixtral", "deepseek")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class MoeShape:
    """The Mixtral-shaped model (flags ``--hidden`` ... ``--head-dim``)."""

    hidden: int = 1024
    expert: int = 2816
    experts: int = 8
    top_k: int = 2
    layers: int = 16
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128


@dataclass(frozen=True)
class DeepseekShape:
    """The DeepSeek-V2-Lite-shaped model (flags ``--deepseek-hidden`` ...)."""

    hidden: int = 512
    expert: int = 384
    experts: int = 16
    top_k: int = 4
    shared: int = 2
    first_dense: int = 1
    layers: int = 6
    heads: int = 8
    kv_lora_rank: int = 256
    qk_nope: int = 64
    qk_rope: int = 32
    v_head: int = 64

    def kv_values_per_token(self) -> tuple[int, int]:
        """(latent cache values, expanded per-head K+V values) per token over all layers."""
        latent = (self.kv_lora_rank + self.qk_rope) * self.layers
        expanded = self.heads * (self.qk_nope + self.qk_rope + self.v_head) * self.layers
        return latent, expanded


def _common(hidden: int, layers: int) -> dict[str, Any]:
    from llmhal.testing.tiny_models import TINY_VOCAB

    return dict(
        vocab_size=TINY_VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=0,
    )


def _mixtral_configs(shape: MoeShape) -> dict[str, Any]:
    import transformers

    common = dict(
        _common(shape.hidden, shape.layers),
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
    )
    return {
        "moe": transformers.MixtralConfig(
            intermediate_size=shape.expert,
            num_local_experts=shape.experts,
            num_experts_per_tok=shape.top_k,
            **common,
        ),
        "dense": transformers.MistralConfig(intermediate_size=shape.top_k * shape.expert, **common),
    }


def _deepseek_configs(shape: DeepseekShape) -> dict[str, Any]:
    import transformers

    active = (shape.top_k + shape.shared) * shape.expert

    def config(first_dense: int) -> Any:
        cfg = transformers.DeepseekV2Config(
            **_common(shape.hidden, shape.layers),
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.heads,
            q_lora_rank=None,
            kv_lora_rank=shape.kv_lora_rank,
            qk_nope_head_dim=shape.qk_nope,
            qk_rope_head_dim=shape.qk_rope,
            v_head_dim=shape.v_head,
            intermediate_size=active,
            moe_intermediate_size=shape.expert,
            n_routed_experts=shape.experts,
            num_experts_per_tok=shape.top_k,
            n_shared_experts=shape.shared,
            first_k_dense_replace=first_dense,
            topk_method="greedy",
            norm_topk_prob=False,
        )
        cfg.architectures = ["DeepseekV2ForCausalLM"]
        return cfg

    return {"moe": config(shape.first_dense), "dense": config(shape.layers)}


def _tag(shape: MoeShape | DeepseekShape) -> str:
    return "-".join(str(getattr(shape, f.name)) for f in fields(shape))


def make_checkpoints(
    folder: Path, shape: MoeShape | DeepseekShape, seed: int = 0
) -> dict[str, Path]:
    """Write the MoE and the dense checkpoints of ``shape``'s family in float32 with the tiny
    tokenizer; reuses checkpoints already written for the same shape."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmhal.testing.tiny_models import TINY_VOCAB, make_tokenizer

    family = "deepseek" if isinstance(shape, DeepseekShape) else "mixtral"
    configs = _deepseek_configs(shape) if family == "deepseek" else _mixtral_configs(shape)  # type: ignore[arg-type]
    out = {}
    for name, config in configs.items():
        target = folder / f"{family}-{name}-{_tag(shape)}"
        out[name] = target
        if (target / "model.safetensors").exists():
            continue
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(str(target), safe_serialization=True)
        make_tokenizer(TINY_VOCAB).save_pretrained(str(target))
        del model
    return out


def _llmhal_worker(a: argparse.Namespace) -> dict[str, Any]:
    from llmhal import LLM, SamplingParams

    llm = LLM(a.model, dtype=a.dtype, max_num_seqs=max(a.batch_sizes),
              enable_prefix_caching=False,  # the timed runs repeat their prompts
              **({"quantization": a.quantization} if a.quantization else {}))  # fmt: skip

    def gen(prompts: list[list[int]], n: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    report = llm.load_report
    out: dict[str, Any] = {"dtype": str(report.dtype).removeprefix("torch."),
                           "weight_bytes": report.weight_bytes,
                           "attention": report.attention_backends}  # fmt: skip
    out.update(_decode_rates(gen, llm.engine.config.model.hf_config.vocab_size, a))
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


def _hf_worker(a: argparse.Namespace) -> dict[str, Any]:
    """``bench ssm``'s transformers worker (the same load and greedy decode), plus peak memory."""
    out = _ssm_hf_worker(a)
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


def run_worker(
    system: str, model: Path, a: argparse.Namespace, dtype: str, quantization: str | None = None
) -> dict[str, Any]:
    """Measure ``model`` with ``system`` ("llmhal" or "hf") in ``dtype`` in a fresh process;
    "llama.cpp": ``a.llama_cpp`` on the GGUF file ``model`` (in the dtype it was written in)."""
    if system == "llama.cpp":
        from llmhal.benchmarks.llama_cpp import measure

        return measure(a.llama_cpp, model, a)
    cmd = [sys.executable, "-m", "llmhal.benchmarks.moe", "--worker", system, "--model",
           str(model), "--dtype", dtype, "--batch-sizes", ",".join(map(str, a.batch_sizes)),
           "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens), "--repeat",
           str(a.repeat)]  # fmt: skip
    if quantization:
        cmd += ["--quantization", quantization]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{system} worker failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _row(name: str, values: list[str]) -> str:
    return f"{name:<34}" + "".join(f"{v:>14}" for v in values)


def _fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{unit}" if x < 100 else f"{x:.0f}{unit}"


def report(results: dict[str, dict[str, Any]], batch_sizes: list[int], title: str = "") -> str:
    """One family's and dtype's table: tokens/s per system and batch by CPU time then by wall
    time, the ratios the issue asks for, memory."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    labels = {"moe": "llmhal MoE", "hf_moe": "transformers MoE", "dense": "llmhal dense (same active)",
              "int8": "llmhal MoE experts_int8", "llama_cpp": "llama.cpp MoE (GGUF)"}  # fmt: skip
    lines = [title] if title else []
    for clock, name in (("decode_cpu", "CPU time"), ("decode", "wall time")):

        def tps(system: str, b: int, clock: str = clock) -> float | None:
            r = results.get(system)
            return None if r is None else float(r[clock][str(b)])

        cols = [f"batch {b}" for b in batch_sizes]
        lines.append(_row(f"decode tok/s ({name})", cols))
        for key, label in labels.items():
            if key in results:
                lines.append(_row(label, [_fmt(tps(key, b)) for b in batch_sizes]))
        lines.append(_row("llmhal / transformers (MoE)", [
            _fmt(ratio(tps("moe", b), tps("hf_moe", b)), "x") for b in batch_sizes]))  # fmt: skip
        if "llama_cpp" in results:
            lines.append(_row("llmhal / llama.cpp (MoE)", [
                _fmt(ratio(tps("moe", b), tps("llama_cpp", b)), "x") for b in batch_sizes]))  # fmt: skip
        lines.append(_row("MoE / dense time per token", [
            _fmt(ratio(tps("dense", b), tps("moe", b)), "x") for b in batch_sizes]))  # fmt: skip
        lines.append(_row("experts_int8 / unquantized speed", [
            _fmt(ratio(tps("int8", b), tps("moe", b)), "x") for b in batch_sizes]))  # fmt: skip
    lines.append("")
    lines.append(_row("memory", ["weights MiB", "peak RSS MiB"]))
    for key, label in labels.items():
        r = results.get(key)
        if r is not None:
            weights = r.get("weight_bytes")
            lines.append(_row(label, [_fmt(weights / 2**20) if weights else "-",
                                      _fmt(r["peak_rss_mb"])]))  # fmt: skip
    return "\n".join(lines)


def kv_report(shape: DeepseekShape, dtype: str) -> str:
    """MLA's KV-cache bytes per token (all layers) against per-head keys and values."""
    size = 2 if dtype == "bfloat16" else 4
    latent, expanded = shape.kv_values_per_token()
    return (
        _row(f"KV bytes/token {dtype}", ["MLA latent", "per-head K/V", "ratio"])
        + "\n"
        + _row("", [str(latent * size), str(expanded * size), _fmt(expanded / latent, "x")])
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="llmhal bench moe", description=__doc__.split("\n\n")[0])
    for f in fields(MoeShape):
        p.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default)
    for f in fields(DeepseekShape):
        p.add_argument("--deepseek-" + f.name.replace("_", "-"), type=int, default=f.default)
    p.add_argument(
        "--family",
        default="mixtral",
        help="mixtral, deepseek, or both comma-separated (measured in turn in the same run)",
    )
    add_decode_args(p)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--no-int8", action="store_true", help="skip the experts_int8 run")
    p.add_argument("--no-dense", action="store_true", help="skip the dense baseline")
    p.add_argument(
        "--llama-cpp",
        metavar="PATH",
        help="also run llama.cpp: its llama-batched-bench binary, on a GGUF file of the "
        "Mixtral-shaped checkpoint (llmhal.benchmarks.llama_cpp)",
    )
    p.add_argument(
        "--workdir", help="keep the generated checkpoints here (reused when the shape matches)"
    )
    p.add_argument("--json", dest="json_path", help="also write the results here")
    p.add_argument("--worker", choices=["llmhal", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--quantization", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.batch_sizes = [int(x) for x in str(a.batch_sizes).split(",")]
    if a.worker:
        result = _llmhal_worker(a) if a.worker == "llmhal" else _hf_worker(a)
        print(json.dumps(result))
        return 0
    families = split_choices(a.family, FAMILIES, "--family")
    dtypes = split_choices(a.dtype, DTYPES, "--dtype")
    shapes: dict[str, MoeShape | DeepseekShape] = {
        "mixtral": MoeShape(**{f.name: getattr(a, f.name) for f in fields(MoeShape)}),
        "deepseek": DeepseekShape(
            **{f.name: getattr(a, "deepseek_" + f.name) for f in fields(DeepseekShape)}
        ),
    }
    if a.workdir:
        folder = Path(a.workdir)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    else:
        folder = Path(tempfile.mkdtemp(prefix="llmhal_bench_moe_"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)

    results: dict[str, dict[str, dict[str, Any]]] = {}
    for family in families:
        ckpt = make_checkpoints(folder, shapes[family])
        for dtype in dtypes:
            runs: dict[str, tuple[str, Path, str | None]] = {"moe": ("llmhal", ckpt["moe"], None)}
            if not a.no_hf:
                runs["hf_moe"] = ("hf", ckpt["moe"], None)
            if not a.no_dense:
                runs["dense"] = ("llmhal", ckpt["dense"], None)
            if not a.no_int8:
                runs["int8"] = ("llmhal", ckpt["moe"], "experts_int8")
            if a.llama_cpp and family == "mixtral":
                from llmhal.benchmarks.llama_cpp import write_mixtral_gguf

                gguf = folder / f"{ckpt['moe'].name}-{dtype}.gguf"
                runs["llama_cpp"] = (
                    "llama.cpp",
                    write_mixtral_gguf(ckpt["moe"], gguf, dtype),
                    None,
                )
            elif a.llama_cpp:
                print(f"{family}: llama.cpp not run (the bench writes GGUF files for the Mixtral "
                      "shape only)", file=sys.stderr)  # fmt: skip
            got = results.setdefault(f"{family} {dtype}", {})
            for key, (system, model, quantization) in runs.items():
                got[key] = run_worker(system, model, a, dtype, quantization)
                # Each figure as it comes: a long run that fails later keeps what it measured.
                print(f"{family} {dtype} {key}: {json.dumps(got[key])}", file=sys.stderr,
                      flush=True)  # fmt: skip
    threads = os.environ.get("OMP_NUM_THREADS", "torch's default")
    print(f"new tokens: {a.new_tokens}  prompt: {a.prompt_len}  threads: {threads}")
    for family in families:
        print(f"{family} shape: {shapes[family]}")
        for dtype in dtypes:
            print(report(results[f"{family} {dtype}"], a.batch_sizes, f"{family} {dtype}"))
            if family == "deepseek":
                print(kv_report(shapes["deepseek"], dtype))  # type: ignore[arg-type]
            print()
    if a.json_path:
        with open(a.json_path, "w") as f:
            shape_json = {fam: shapes[fam].__dict__ for fam in families}
            json.dump({"shapes": shape_json, "results": results, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
