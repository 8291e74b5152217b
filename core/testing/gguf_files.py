"""GGUF test data: valid random quantized rows, and tiny GGUF model files written with gguf's writer.

``quantized_rows`` gives uint8 rows exactly as a GGUF file stores them: formats the gguf package can
quantize are quantized from random weights; K-quants are random blocks with finite fp16 scales
(every code and sub-scale pattern occurs). ``write_tiny_gguf`` writes a small llama/qwen2/qwen3
model the way llama.cpp's converter does (llama q/k rows permuted for its rotary layout) and
returns the raw rows in HF order, which a loader must give back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Byte offsets of the fp16 fields (d, m/dmin) in each block (llama.cpp's ggml-common.h).
FP16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}  # fmt: skip
GGUF_QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf.quants can produce these


def random_blocks(name: str, n_blocks: int, seed: int = 0, scale: float = 0.05) -> np.ndarray:
    """uint8 ``[n_blocks, type_size]`` of type ``name``: random bytes, finite fp16 scale fields."""
    import gguf

    rng = np.random.default_rng(seed)
    _, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for pos in FP16_FIELDS[name]:
        f16 = (rng.standard_normal(n_blocks) * scale).astype(np.float16)
        blocks[:, pos : pos + 2] = f16.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def quantized_rows(name: str, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 ``[rows, row_bytes]``: a ``rows x k`` weight of GGUF type ``name`` (F32/F16 too,
    returned as float tensors, as a GGUF loader yields them)."""
    import gguf

    rng = np.random.default_rng(seed)
    if name in ("F32", "F16"):
        w = rng.standard_normal((rows, k)).astype(np.float32) * 0.05
        return torch.from_numpy(w.astype(np.float16 if name == "F16" else np.float32))
    from llmhal.quantization.gguf_dequant import ggml_type

    ggml_type(name).row_bytes(k)  # a k that does not fill whole blocks: a clear error
    qtype = gguf.GGMLQuantizationType[name]
    if name in GGUF_QUANTIZABLE:
        w = (rng.standard_normal((rows, k)) * rng.uniform(0.01, 0.1, (rows, 1))).astype(np.float32)
        return torch.from_numpy(gguf.quants.quantize(w, qtype))
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return torch.from_numpy(random_blocks(name, rows * k // block, seed).reshape(rows, -1))


def store_tensor(writer: Any, name: str, data: torch.Tensor, qtype: str | None) -> torch.Tensor:
    """Add ``data`` to a ``gguf.GGUFWriter`` as tensor ``name`` of GGUF type ``qtype`` (None: F32;
    K-quants, which gguf cannot quantize, as random blocks of small finite scales); return the
    values the file now holds, in float32 and ``data``'s shape (for the reference model)."""
    import gguf

    arr = data.detach().float().contiguous().numpy()
    if qtype is None:
        writer.add_tensor(name, arr)
        return torch.from_numpy(arr.copy())
    t = gguf.GGMLQuantizationType[qtype]
    if qtype == "F16":
        half = arr.astype(np.float16)
        writer.add_tensor(name, half)
        return torch.from_numpy(half.astype(np.float32))
    if qtype in GGUF_QUANTIZABLE:
        raw = gguf.quants.quantize(arr, t)
    else:
        block = gguf.GGML_QUANT_SIZES[t][0]
        raw = random_blocks(qtype, arr.size // block, seed=arr.size, scale=5e-4)
        raw = raw.reshape(*arr.shape[:-1], -1)
    writer.add_tensor(name, raw, raw_dtype=t)
    return torch.from_numpy(gguf.quants.dequantize(raw, t).astype(np.float32)).view(data.shape)


def llama_cpp_permute(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """The row order llama.cpp's converter writes llama q/k weights in (per head: the first half
    of the rows interleaved with the second half)."""
    rows = t.shape[0]
    return t.reshape(n_head, 2, rows // n_head // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


@dataclass
class TinyGGUF:
    path: Path
    arch: str
    hf_tensors: dict[str, torch.Tensor]  # HF name -> raw rows (or float tensor) in HF row order
    types: dict[str, str]  # HF name -> GGUF type name
    config: dict[str, int] = field(default_factory=dict)


def write_tiny_gguf(
    path: str | Path,
    arch: str = "llama",
    *,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    inter: int = 128,
    vocab: int = 96,
    head_dim: int | None = None,
    weight_type: str = "Q8_0",
    types: dict[str, str] | None = None,
    tie: bool = True,
    omit: tuple[str, ...] = (),
    extra: dict[str, tuple[tuple[int, ...], int]] | None = None,
    seed: int = 0,
) -> TinyGGUF:
    """Write a tiny ``arch`` model. ``types`` overrides ``weight_type`` per GGUF base name suffix
    (``attn_v``, ``token_embd``...); ``omit`` drops GGUF tensors by name; ``extra`` adds raw tensors
    ``{gguf name: (ggml shape, type id)}`` of zero bytes (for error tests)."""
    import gguf

    hd = head_dim or hidden // heads
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    if arch == "llama":
        writer.add_rope_dimension_count(hd)
    if head_dim is not None:
        writer.add_key_length(hd)
        writer.add_value_length(hd)
    types = types or {}
    out = TinyGGUF(Path(path), arch, {}, {}, dict(hidden=hidden, heads=heads, kv_heads=kv_heads))
    counter = iter(range(10_000))

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], permute_heads: int = 0) -> None:
        base = gguf_name.rsplit(".", 1)[0].split(".")[-1]
        if len(shape) == 1:
            t = torch.from_numpy((1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            name = "F32"
        else:
            name = types.get(base, weight_type)
            t = quantized_rows(name, shape[0], shape[1], seed=seed * 1000 + next(counter))
        out.hf_tensors[hf_name], out.types[hf_name] = t, name
        if gguf_name in omit:
            return
        stored = llama_cpp_permute(t, permute_heads) if permute_heads else t
        arr = stored.contiguous().numpy()
        raw_dtype = None if name in ("F32", "F16") else gguf.GGMLQuantizationType[name]
        writer.add_tensor(gguf_name, arr, raw_dtype=raw_dtype)

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden))
    add("output_norm.weight", "model.norm.weight", (hidden,))
    if not tie:
        add("output.weight", "lm_head.weight", (vocab, hidden))
    permute = arch == "llama"
    for i in range(layers):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        add(b + "attn_norm.weight", h + "input_layernorm.weight", (hidden,))
        add(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (hidden,))
        add(
            b + "attn_q.weight",
            h + "self_attn.q_proj.weight",
            (heads * hd, hidden),
            heads * permute,
        )
        add(b + "attn_k.weight", h + "self_attn.k_proj.weight", (kv_heads * hd, hidden), kv_heads * permute)  # fmt: skip
        add(b + "attn_v.weight", h + "self_attn.v_proj.weight", (kv_heads * hd, hidden))
        add(b + "attn_output.weight", h + "self_attn.o_proj.weight", (hidden, heads * hd))
        add(b + "ffn_gate.weight", h + "mlp.gate_proj.weight", (inter, hidden))
        add(b + "ffn_up.weight", h + "mlp.up_proj.weight", (inter, hidden))
        add(b + "ffn_down.weight", h + "mlp.down_proj.weight", (hidden, inter))
        if arch == "qwen2":
            for x, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                add(b + f"attn_{x}.bias", h + f"self_attn.{x}_proj.bias", (n * hd,))
        if arch == "qwen3":
            add(b + "attn_q_norm.weight", h + "self_attn.q_norm.weight", (hd,))
            add(b + "attn_k_norm.weight", h + "self_attn.k_norm.weight", (hd,))
    for name, (shape, type_id) in (extra or {}).items():
        qtype = gguf.GGMLQuantizationType(type_id)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((*shape[1:][::-1], shape[0] // block * type_size), dtype=np.uint8)
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def count_tokenizer_conversions(monkeypatch: Any) -> list[str]:
    """Records each tokenizer converted from a GGUF file's vocabulary (rather than read back from
    the tokenizer cache) while ``monkeypatch`` (pytest's fixture) is in effect: the file names."""
    from transformers import PreTrainedTokenizerFast

    calls: list[str] = []
    real = PreTrainedTokenizerFast.from_pretrained.__func__

    def counting(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("gguf_file"):
            calls.append(kwargs["gguf_file"])
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "from_pretrained", classmethod(counting))
    return calls
