"""llama.cpp as a baseline of ``llmhal bench moe --llama-cpp PATH``: the bench's Mixtral-shaped
checkpoint written as a GGUF file in the layout llama.cpp's converter gives Mixtral, decoded by
llama.cpp's ``llama-batched-bench`` and timed the way the bench times every system.

llama.cpp is not a dependency: build ``llama-batched-bench`` from its sources (``cmake -B build
&& cmake --build build --target llama-batched-bench``) and pass the binary.

The file is written here, not by llama.cpp's ``convert_hf_to_gguf.py``, because that converter
refuses a BPE tokenizer whose pre-tokenizer it does not know by hash, and the bench's tiny test
tokenizer is one; the timed runs feed token ids, so the tokenizer's pre-tokenizer does not matter
to them. The layout is the converter's for Mixtral: the ``llama`` architecture with expert counts,
q/k rows in llama.cpp's rotary order, each layer's experts as 3-D ``ffn_{gate,up,down}_exps``
tensors, router and norms in float32, the other matrices in the bench's dtype. On the bench's
Mixtral-shaped checkpoint the converter's own file (its tokenizer check bypassed) holds the same
163 tensors, byte for byte, and adds only descriptive keys (docs/moe.md); llmhal reads the file
back to the checkpoint's greedy tokens (tests/benchmarks/test_llama_cpp_bench.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

# GGUF token types (llama.cpp's llama_token_type): ordinary, control (special), user-defined.
_NORMAL, _CONTROL, _USER = 1, 3, 4


def write_mixtral_gguf(checkpoint: Path, dst: Path, dtype: str) -> Path:
    """Write the Mixtral safetensors ``checkpoint`` (the bench's: one file, experts as
    ``block_sparse_moe.experts.N.w1/w2/w3``) as the GGUF file ``dst`` with its matrices in
    ``dtype`` ("float32" or "bfloat16"); an existing ``dst`` is kept."""
    import gguf
    import numpy as np
    import torch
    from safetensors import safe_open

    if dst.exists():
        return dst
    c = json.loads((checkpoint / "config.json").read_text())
    if c.get("architectures") != ["MixtralForCausalLM"]:
        raise ValueError(f"{checkpoint}: a MixtralForCausalLM checkpoint is needed for llama.cpp")
    hd = c["head_dim"]
    bf16 = dtype == "bfloat16"
    tmp = dst.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32))
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(float(c["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_vocab_size(c["vocab_size"])
    _add_tokenizer(w, checkpoint / "tokenizer.json", c)

    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        plan = _mixtral_tensors(f, c)
        # Streamed: every tensor's header entry first, then the tensors one at a time, so the
        # bench's process never holds the model.
        for name, shape, matrix, _ in plan:
            raw = gguf.GGMLQuantizationType.BF16 if bf16 and matrix else None
            size = 2 if raw is not None else 4
            w.add_tensor_info(name, shape, np.dtype(np.int16 if raw is not None else np.float32),
                              math.prod(shape) * size, raw_dtype=raw)  # fmt: skip
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, shape, matrix, load in plan:
            t = load().contiguous()
            # BF16 as the converter stores it: the 16-bit patterns of the rounded values.
            arr = t.to(torch.bfloat16).view(torch.int16) if bf16 and matrix else t.float()
            w.write_tensor_data(arr.numpy().reshape(shape))
        w.close()
    tmp.replace(dst)
    return dst


def _mixtral_tensors(f: Any, c: dict[str, Any]) -> list[tuple[str, tuple[int, ...], bool, Any]]:
    """The GGUF tensors of the Mixtral checkpoint open in ``f``, in the converter's names and
    layout: (name, shape, whether a matrix (stored in the file's dtype; else float32), a loader)."""
    import torch

    from llmhal.testing.gguf_files import llama_cpp_permute

    heads, kv, experts = c["num_attention_heads"], c["num_key_value_heads"], c["num_local_experts"]

    def one(name: str, permute: int = 0) -> tuple[tuple[int, ...], Any]:
        shape = tuple(f.get_slice(name).get_shape())
        if permute:
            return shape, lambda: llama_cpp_permute(f.get_tensor(name), permute)
        return shape, lambda: f.get_tensor(name)

    def stacked(names: list[str]) -> tuple[tuple[int, ...], Any]:
        shape = (len(names), *f.get_slice(names[0]).get_shape())
        return shape, lambda: torch.stack([f.get_tensor(n) for n in names])

    plan = []

    def add(gguf_name: str, spec: tuple[tuple[int, ...], Any], matrix: bool = True) -> None:
        plan.append((gguf_name, spec[0], matrix, spec[1]))

    add("token_embd.weight", one("model.embed_tokens.weight"))
    add("output_norm.weight", one("model.norm.weight"), matrix=False)
    add("output.weight", one("lm_head.weight"))
    for i in range(c["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", one(p + "input_layernorm.weight"), matrix=False)
        add(b + "ffn_norm.weight", one(p + "post_attention_layernorm.weight"), matrix=False)
        add(b + "attn_q.weight", one(p + "self_attn.q_proj.weight", heads))
        add(b + "attn_k.weight", one(p + "self_attn.k_proj.weight", kv))
        add(b + "attn_v.weight", one(p + "self_attn.v_proj.weight"))
        add(b + "attn_output.weight", one(p + "self_attn.o_proj.weight"))
        moe = p + "block_sparse_moe."
        add(b + "ffn_gate_inp.weight", one(moe + "gate.weight"), matrix=False)
        for hf, g in (("w1", "ffn_gate_exps"), ("w2", "ffn_down_exps"), ("w3", "ffn_up_exps")):
            add(
                f"{b}{g}.weight", stacked([f"{moe}experts.{e}.{hf}.weight" for e in range(experts)])
            )
    return plan


def _add_tokenizer(w: Any, path: Path, config: dict[str, Any]) -> None:
    """The byte-level BPE tokenizer of ``path`` as GGUF's ``gpt2`` tokenizer (vocabulary, token
    types, merges, BOS/EOS), the pre-tokenizer ``default``; ids past the vocabulary up to the
    model's vocab_size are padding entries, as the converter writes them."""
    tok = json.loads(path.read_text())
    if tok["model"]["type"] != "BPE":
        raise ValueError(f"{path}: a BPE tokenizer is needed, not {tok['model']['type']}")
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    types = dict.fromkeys(by_id, _NORMAL)
    for added in tok.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        types[added["id"]] = _CONTROL if added.get("special") else _USER
    size = config["vocab_size"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([by_id.get(i, f"[PAD{i}]") for i in range(size)])
    w.add_token_types([types.get(i, _USER) for i in range(size)])
    merges = tok["model"].get("merges", [])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])


def _timed(cmd: list[str], tg: int) -> tuple[float, float] | None:
    """Run ``llama-batched-bench`` as ``cmd`` (``--output-format jsonl``): (its CPU seconds, its
    own clock ``t_tg`` of the decode steps of its configuration of ``tg`` steps), or None when it
    exits without printing that result. The CPU time is the process's own (the children's totals would
    mix in the bench's other workers). Its peak memory is not taken: its ru_maxrss carries this
    process's peak (see benchmarks.engine._peak_rss_mb), and /proc's figure is gone once it ends."""
    # Its warnings go to a file: on the same pipe as the results they can split a result line.
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log)
        assert proc.stdout is not None
        text = proc.stdout.read().decode(errors="replace")  # to the end first: a full pipe stalls
        proc.stdout.close()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        if proc.returncode != 0:
            log.seek(0)
            err = log.read().decode(errors="replace")
            raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}):\n{(err + text)[-3000:]}")
    rows = [json.loads(line) for line in text.splitlines() if line.startswith('{"n_kv_max"')]
    rows = [r for r in rows if r["tg"] == tg]
    if not rows:
        return None
    return usage.ru_utime + usage.ru_stime, float(rows[0]["t_tg"])


# llama.cpp prints through a logging thread that nothing flushes at exit (common/log.cpp keeps
# its logger in a pointer never destroyed), so the last line of a run may be lost: the result of
# a tiny model's run, printed just before it exits, was missing in 2-4 of 12 runs. Each run
# therefore ends with a second, cheap configuration (one decode step) after the one measured, which
# gives the thread time to write the first; it costs the same in both runs of a difference, so it
# cancels. A run whose result is missing all the same is repeated, up to this many times.
_TRIES = 5


def measure(binary: str, model: Path, a: Any) -> dict[str, Any]:
    """Decode tokens/s of ``llama-batched-bench`` on the GGUF ``model`` at each of the bench's
    batch sizes, as the bench measures the other systems: a run of ``1 + new_tokens`` tokens
    minus a run of 1 (the load, warm-up and prompts cancel), the least of ``repeat`` runs each,
    by the process's CPU time, and by llama.cpp's own clock of its decode steps for wall time;
    threads as ``OMP_NUM_THREADS`` says."""
    threads = os.environ.get("OMP_NUM_THREADS") or str(os.cpu_count() or 1)
    out: dict[str, Any] = {"decode": {}, "decode_cpu": {}, "weight_bytes": model.stat().st_size}

    def best(batch: int, new: int) -> tuple[float, float]:
        # Each sequence's share of the context, whole: llama.cpp rounds a context that its
        # sequences do not divide down, and skips a configuration that then does not fit.
        per_seq = -(-(a.prompt_len + new + 1) // 256) * 256
        cmd = [binary, "-m", str(model), "-c", str(batch * per_seq), "-b", "2048", "-ub", "512",
               "-npp", str(a.prompt_len), "-ntg", f"{new},1", "-npl", str(batch),
               "-t", threads, "-tb", threads, "--output-format", "jsonl"]  # fmt: skip
        runs = []
        for _ in range(max(1, a.repeat)):
            got = None
            for _ in range(_TRIES):
                if (got := _timed(cmd, new)) is not None:
                    break
            if got is None:
                raise RuntimeError(f"{' '.join(cmd)} printed no result {_TRIES} times")
            runs.append(got)
        return min(r[0] for r in runs), min(r[1] for r in runs)

    for b in a.batch_sizes:
        (c1, w1), (cn, wn) = best(b, 1), best(b, 1 + a.new_tokens)
        out["decode_cpu"][str(b)] = b * a.new_tokens / max(cn - c1, 1e-9)
        out["decode"][str(b)] = b * a.new_tokens / max(wn - w1, 1e-9)
    out["peak_rss_mb"] = None  # see _timed
    return out
