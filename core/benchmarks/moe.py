"""``llmhal bench moe``: a Mixtral-shaped MoE model against transformers, against a dense model with
the same active parameters, and with ``experts_int8``, in one run.

The checkpoints are tiny-random but realistically shaped, built here with transformers' own classes
(default: Mixtral's layout scaled to hidden 1024, 8 experts of width 2816, top-2, 16 layers, 8
query heads over 2 KV heads of 128). The dense baseline is the same decoder with one MLP of width
``top_k * expert`` (a Mistral config): per token it reads the same number of weights as the MoE
model's chosen experts, so the ratio of their times per token says what routing, grouping and the
extra experts cost. The vocabulary is the tiny test tokenizer's (384 ids), so the LM head does not
dilute that ratio.

Every system runs in its own worker process (``llmhal bench engine``'s workers: best of
``--repeat`` timed runs after an untimed warm-up): decode tokens/s at each batch size, weight bytes
and peak resident memory.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmhal.benchmarks.engine import WorkerSpec, add_workload_args, run_worker


@dataclass(frozen=True)
class MoeShape:
    hidden: int = 1024
    expert: int = 2816
    experts: int = 8
    top_k: int = 2
    layers: int = 16
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128


def make_checkpoints(folder: Path, shape: MoeShape, seed: int = 0) -> dict[str, Path]:
    """Write the MoE (Mixtral) and the dense (Mistral, MLP width top_k * expert) checkpoints in
    float32 with the tiny tokenizer; reuses checkpoints already written for the same shape."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from llmhal.testing.tiny_models import TINY_VOCAB, make_tokenizer

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=0,
    )
    configs = {
        "moe": transformers.MixtralConfig(
            intermediate_size=shape.expert,
            num_local_experts=shape.experts,
            num_experts_per_tok=shape.top_k,
            **common,
        ),
        "dense": transformers.MistralConfig(intermediate_size=shape.top_k * shape.expert, **common),
    }
    out = {}
    for name, config in configs.items():
        target = folder / f"{name}-{shape.hidden}-{shape.expert}x{shape.experts}-{shape.layers}"
        out[name] = target
        if (target / "model.safetensors").exists():
            continue
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(str(target), safe_serialization=True)
        make_tokenizer(TINY_VOCAB).save_pretrained(str(target))
        del model
    return out


def _row(name: str, values: list[str]) -> str:
    return f"{name:<34}" + "".join(f"{v:>14}" for v in values)


def _fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{unit}" if x < 100 else f"{x:.0f}{unit}"


def report(results: dict[str, dict[str, Any]], batch_sizes: list[int]) -> str:
    """The table: tokens/s per system and batch, the ratios the issue asks for, memory."""

    def tps(system: str, b: int) -> float | None:
        r = results.get(system)
        return None if r is None else float(r["decode"][str(b)])

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    cols = [f"batch {b}" for b in batch_sizes]
    lines = [_row("decode tok/s", cols)]
    labels = {"moe": "llmhal MoE", "hf_moe": "transformers MoE", "dense": "llmhal dense (same active)",
              "int8": "llmhal MoE experts_int8"}  # fmt: skip
    for key, label in labels.items():
        if key in results:
            lines.append(_row(label, [_fmt(tps(key, b)) for b in batch_sizes]))
    lines.append(_row("llmhal / transformers (MoE)", [
        _fmt(ratio(tps("moe", b), tps("hf_moe", b)), "x") for b in batch_sizes]))  # fmt: skip
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="llmhal bench moe", description=__doc__.split("\n\n")[0])
    for field_name, default in MoeShape.__dataclass_fields__.items():
        flag = "--" + field_name.replace("_", "-")
        p.add_argument(flag, type=int, default=default.default)
    p.add_argument("--dtype", default="float32")
    add_workload_args(p, batch_sizes="1,8", new_tokens=32, prefill_len=64, repeat=2)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--no-int8", action="store_true", help="skip the experts_int8 run")
    p.add_argument("--no-dense", action="store_true", help="skip the dense baseline")
    p.add_argument(
        "--workdir", help="keep the generated checkpoints here (reused when the shape matches)"
    )
    p.add_argument("--json", dest="json_path", help="also write the results here")
    a = p.parse_args(argv)
    a.batch_sizes = [int(x) for x in str(a.batch_sizes).split(",")]
    shape = MoeShape(**{f: getattr(a, f) for f in MoeShape.__dataclass_fields__})
    if a.workdir:
        folder = Path(a.workdir)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    else:
        folder = Path(tempfile.mkdtemp(prefix="llmhal_bench_moe_"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    ckpt = make_checkpoints(folder, shape)

    def spec(model: Path, quantization: str | None = None) -> WorkerSpec:
        return WorkerSpec(str(model), a.dtype, quantization, tuple(a.batch_sizes), a.new_tokens,
                          a.prompt_len, a.prefill_len, a.repeat)  # fmt: skip

    runs: dict[str, tuple[str, WorkerSpec]] = {"moe": ("llmhal", spec(ckpt["moe"]))}
    if not a.no_hf:
        runs["hf_moe"] = ("hf", spec(ckpt["moe"]))
    if not a.no_dense:
        runs["dense"] = ("llmhal", spec(ckpt["dense"]))
    if not a.no_int8:
        runs["int8"] = ("llmhal", spec(ckpt["moe"], "experts_int8"))
    results = {key: run_worker(system, s) for key, (system, s) in runs.items()}
    print(f"shape: {shape}  dtype: {a.dtype}  new tokens: {a.new_tokens}  prompt: {a.prompt_len}")
    print(report(results, a.batch_sizes))
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"shape": shape.__dict__, "results": results, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
