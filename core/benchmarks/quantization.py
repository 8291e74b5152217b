"""``llmhal bench quantization``: one model in several weight formats, measured in one run.

From the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) it derives, once, into a cache folder:

* ``q4_1``  the GGUF file as shipped (``gguf`` method);
* ``q8_0``  the same weights re-quantized to Q8_0 with the gguf package (``gguf`` method);
* ``bf16``  the weights dequantized by transformers' GGUF loader, saved as a bf16 safetensors folder;
* ``fp8``   that folder quantized online (``quantization="fp8"``, e4m3 weights, per-channel scales);
* ``int8``  that folder quantized by the compressed-tensors library, W8A16 (int8 weights, one scale per
  output channel), loaded through the ``compressed-tensors`` method.

Each variant runs in its own worker process (see :mod:`llmhal.benchmarks.engine`): weight bytes held,
decode tokens/s at each batch size, prefill tokens/s and peak RSS. Ratios are against ``q4_1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

VARIANTS = ("q4_1", "q8_0", "fp8", "int8", "bf16")


def _workdir(workdir: Path | None) -> Path:
    """Where the derived checkpoints are kept: ``workdir``, else the cache's ``bench`` folder. They
    are read back (weights, tokenizer, chat template), so a folder someone else could have
    written is not used (:mod:`llmhal.utils.private_dir`): they are built for this run instead."""
    from llmhal.envs import cache_root
    from llmhal.utils import private_dir

    try:
        return private_dir.ensure(workdir) if workdir else private_dir.ensure(cache_root(), "bench")
    except private_dir.UnsafeDirError as e:
        where = workdir or cache_root()
        private_dir.warn_once(where, str(e), "Derived checkpoints are built for this run only")
        return private_dir.fresh_dir("bench")


def requantize_gguf(src: str, dst: Path, qtype_name: str = "Q8_0") -> Path:
    """Write ``src`` with every quantized tensor re-quantized to ``qtype_name`` (metadata copied)."""
    import gguf
    import numpy as np

    if dst.exists():
        return dst
    qtype = gguf.GGMLQuantizationType[qtype_name]
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if name == "general.file_type":
            value = int(gguf.LlamaFileType[f"MOSTLY_{qtype_name}"])
        writer.add_key_value(name, value, vtype, sub_type=sub)
    float_types = (
        gguf.GGMLQuantizationType.F32,
        gguf.GGMLQuantizationType.F16,
        gguf.GGMLQuantizationType.BF16,
    )
    for t in reader.tensors:
        if t.tensor_type in float_types:
            writer.add_tensor(t.name, np.asarray(t.data))
            continue
        dense = gguf.quants.dequantize(t.data, t.tensor_type)
        writer.add_tensor(t.name, gguf.quants.quantize(dense, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return dst


def dense_folder(src: str, dst: Path) -> Path:
    """The GGUF weights as transformers dequantizes them, saved as bf16 safetensors + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmhal.model_loader.gguf_loader import GGUFFile

    if (dst / "config.json").exists():
        return dst
    folder, name = os.path.split(src)
    loaded = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.bfloat16, trust_remote_code=False
    )
    # transformers refuses to save a model it loaded from GGUF; copy it into a plain one.
    config = loaded.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(dst)
    GGUFFile(src).tokenizer().save_pretrained(dst)
    return dst


def int8_folder(dense: Path, dst: Path) -> Path:
    """W8A16 (int8, per output channel, symmetric) made by the compressed-tensors library."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (dst / "config.json").exists():
        return dst
    model = AutoModelForCausalLM.from_pretrained(
        dense, dtype=torch.bfloat16, trust_remote_code=False
    )
    qc = QuantizationConfig(
        config_groups={
            "group_0": QuantizationScheme(
                targets=["Linear"],
                weights=QuantizationArgs(
                    num_bits=8, type="int", symmetric=True, strategy="channel"
                ),
            )
        },
        ignore=["lm_head"],
        quantization_status=QuantizationStatus.FROZEN,
    )
    apply_quantization_config(model, qc, show_progress=False)
    # Weight-only: the scales follow from the weights (per-channel min/max), no activations needed.
    for mod in model.modules():
        scheme = getattr(mod, "quantization_scheme", None)
        if scheme is not None:
            w = mod.weight.data
            scale, zp = calculate_qparams(
                w.amin(1, keepdim=True), w.amax(1, keepdim=True), scheme.weights
            )
            mod.weight_scale.data = scale.reshape(mod.weight_scale.shape).to(mod.weight_scale.dtype)
            if hasattr(mod, "weight_zero_point"):
                mod.weight_zero_point.data = zp.reshape(mod.weight_zero_point.shape).to(
                    mod.weight_zero_point.dtype
                )
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    AutoTokenizer.from_pretrained(dense, trust_remote_code=False).save_pretrained(dst)
    return dst


def prepare(variants: list[str], source: str, root: Path) -> dict[str, tuple[str, str | None]]:
    """variant -> (model path, quantization argument); ``root`` is a checked :func:`_workdir`."""
    from llmhal.utils import private_dir

    for name in ("smollm2-q8_0.gguf", "smollm2-bf16", "smollm2-w8a16"):
        private_dir.discard_untrusted(root / name, "It is built again")
    out: dict[str, tuple[str, str | None]] = {}
    dense = None
    for v in variants:
        if v == "q4_1":
            out[v] = (source, None)
        elif v == "q8_0":
            out[v] = (str(requantize_gguf(source, root / "smollm2-q8_0.gguf")), None)
        elif v in ("bf16", "fp8", "int8"):
            dense = dense or dense_folder(source, root / "smollm2-bf16")
            if v == "int8":
                out[v] = (str(int8_folder(dense, root / "smollm2-w8a16")), None)
            else:
                out[v] = (str(dense), "fp8" if v == "fp8" else None)
        else:
            raise ValueError(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    return out


def main(argv: list[str] | None = None) -> int:
    from llmhal.benchmarks.engine import WorkerSpec, add_workload_args, run_worker

    p = argparse.ArgumentParser(
        prog="llmhal bench quantization", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument(
        "--dtype", default="auto", help="activation dtype for every variant (auto: per checkpoint)"
    )
    add_workload_args(p, batch_sizes="1,16", new_tokens=32, prefill_len=256, repeat=1)
    p.add_argument(
        "--workdir", type=Path, default=None, help="where derived checkpoints are cached"
    )
    p.add_argument("--json", dest="json_path")
    a = p.parse_args(argv)
    if a.model is None:
        from llmhal.default_model import default_model_path

        a.model = default_model_path()
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    batch = tuple(int(b) for b in a.batch_sizes.split(","))
    paths = prepare(variants, a.model, _workdir(a.workdir))
    results: dict[str, Any] = {}
    for v in variants:
        model, quant = paths[v]
        spec = WorkerSpec(
            model, a.dtype, quant, batch, a.new_tokens, a.prompt_len, a.prefill_len, a.repeat
        )
        results[v] = run_worker("llmhal", spec)
        print(f"  measured {v}", file=sys.stderr)
    base = results.get("q4_1")
    head = f"{'variant':<8}{'method':<20}{'dtype':<10}{'weights MiB':>12}" + "".join(
        f"{f'decode b={b}':>14}" for b in batch
    )
    print(f"model: {a.model}\n{head}{'prefill tok/s':>15}")
    for v in variants:
        r = results[v]
        cells = "".join(f"{r['decode'][str(b)]:>14.1f}" for b in batch)
        print(
            f"{v:<8}{r['quantization'] or 'none':<20}{r['dtype']:<10}{r['weight_bytes'] / 2**20:>12.1f}{cells}{r['prefill_tps']:>15.1f}"
        )
    if base:
        print("ratios vs q4_1 (decode): " + "; ".join(
            f"{v}: " + ", ".join(f"b={b} {results[v]['decode'][str(b)] / base['decode'][str(b)]:.2f}x" for b in batch)
            for v in variants if v != "q4_1"))  # fmt: skip
    if a.json_path:
        Path(a.json_path).write_text(json.dumps({"variants": results, "paths": paths}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
