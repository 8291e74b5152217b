"""Configs of the built-in architectures are built without importing transformers' per-architecture
config classes (~1.6 s of a load). Every field the engine reads, the RoPE table and sliding windows
it derives, and every other field of ``to_dict()``, must equal what transformers' own class gives:
for the field sets a GGUF file yields, for ``save_pretrained`` config.json files, and for the
shapes of config.json that published checkpoints use."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmhal.model_loader.hf_config import config_for
from llmhal.testing.config_reading import assert_configs_read_alike

# The field sets GGUFFile.config_dict produces: what it always sets (num_key_value_heads defaults
# to the head count there, tie_word_embeddings comes from the tensors), and what optional metadata
# adds.
BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 3, "intermediate_size": 96, "vocab_size": 300,
        "tie_word_embeddings": True}  # fmt: skip
VARIANTS = {
    "minimal": {},
    "full": {"num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
             "max_position_embeddings": 512, "head_dim": 16, "tie_word_embeddings": True,
             "bos_token_id": 7, "eos_token_id": 8, "pad_token_id": 9},
    "linear_rope": {"rope_theta": 50000.0, "max_position_embeddings": 256,
                    "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "yarn_rope": {"max_position_embeddings": 1024, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}},
    "biased": {"attention_bias": True, "tie_word_embeddings": False},
}  # fmt: skip
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "mistral": "MistralForCausalLM"}  # fmt: skip

# config.json shapes of published checkpoints (sizes shrunk), written by hand rather than by
# save_pretrained: older transformers versions, and fields left out.
PUBLISHED = {
    "llama3_rope": ("llama", {"rope_theta": 500000.0, "max_position_embeddings": 512,
                              "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 128}}),
    "old_rope_type_key": ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    "no_kv_heads": ("llama", {"num_key_value_heads": None}),
    "qwen2_window_off": ("qwen2", {"use_sliding_window": False, "sliding_window": 512,
                                   "max_window_layers": 2}),
    "qwen2_window_on": ("qwen2", {"use_sliding_window": True, "sliding_window": 16,
                                  "max_window_layers": 1}),
    "qwen3_window_on": ("qwen3", {"use_sliding_window": True, "sliding_window": 16,
                                  "max_window_layers": 2, "head_dim": 32}),
    "mistral_no_window": ("mistral", {"sliding_window": None, "head_dim": None}),
    "mistral_window": ("mistral", {"sliding_window": 32}),
    "bf16": ("qwen2", {"torch_dtype": "bfloat16", "rope_scaling": None}),
}  # fmt: skip

# Not compared as raw to_dict() entries: the RoPE parameters' form (the table built from them is)
# and where the model was read from.
_FORM = {"rope_parameters", "rope_scaling", "rope_theta", "transformers_version", "_name_or_path"}


def _assert_same(ours, theirs) -> None:
    assert_configs_read_alike(ours, theirs)
    assert ours.model_type == theirs.model_type
    mine = {k: v for k, v in ours.to_dict().items() if k not in _FORM}
    other = {k: v for k, v in theirs.to_dict().items() if k not in _FORM}
    assert mine == other


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")  # transformers'
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("model_type", list(ARCHS))
def test_gguf_field_sets_read_as_transformers_own(model_type, variant):
    from transformers import AutoConfig

    fields = {**BASE, "architectures": [ARCHS[model_type]], **VARIANTS[variant]}
    if model_type in ("qwen2", "mistral"):
        fields.pop("attention_bias", None)  # no such field (Qwen2's q/k/v always have a bias)
    _assert_same(config_for(model_type, dict(fields)), AutoConfig.for_model(model_type, **fields))


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")
@pytest.mark.parametrize("case", ["saved:" + a for a in ARCHS] + list(PUBLISHED))
def test_config_json_reads_as_transformers_own(case, tmp_path):
    """Through the safetensors checkpoint's own reading of config.json."""
    from transformers import AutoConfig

    from llmhal.model_loader.checkpoint import SafetensorsCheckpoint
    from llmhal.model_loader.source import resolve_source
    from llmhal.testing.model_parity import tiny_config

    if case.startswith("saved:"):
        model_type = case.removeprefix("saved:")
        tiny_config(ARCHS[model_type]).save_pretrained(tmp_path)
    else:
        model_type, fields = PUBLISHED[case]
        body = {**BASE, "model_type": model_type, "architectures": [ARCHS[model_type]], **fields}
        (tmp_path / "config.json").write_text(json.dumps(body))
    (tmp_path / "model.safetensors").write_bytes(b"")  # makes it a model folder; never read
    ckpt = SafetensorsCheckpoint(resolve_source(str(tmp_path)))
    assert type(ckpt.hf_config).__name__.startswith("Light")
    _assert_same(ckpt.hf_config, AutoConfig.from_pretrained(str(tmp_path)))


@pytest.mark.parametrize("arch", ["GemmaForCausalLM", "remote code"])
def test_other_model_types_and_remote_code_still_go_through_autoconfig(tmp_path, arch):
    from llmhal.model_loader.checkpoint import SafetensorsCheckpoint
    from llmhal.model_loader.source import resolve_source
    from llmhal.testing.model_parity import tiny_config

    cfg = tiny_config("LlamaForCausalLM" if arch == "remote code" else arch)
    if arch == "remote code":
        cfg.auto_map = {"AutoConfig": "configuration_custom.CustomConfig"}
    cfg.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    ckpt = SafetensorsCheckpoint(resolve_source(str(tmp_path)))
    assert type(ckpt.hf_config).__name__ == type(cfg).__name__  # transformers' own class


def test_loading_a_model_imports_no_config_class(tmp_path):
    """The point of it: the default model's load does not import LlamaConfig's module chain."""
    from llmhal.testing.gguf_files import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf").path
    code = (
        "import sys\n"
        "from llmhal.model_loader.gguf_loader import GGUFFile\n"
        f"cfg = GGUFFile({str(path)!r}).hf_config()\n"
        "assert cfg.architectures, cfg\n"
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models.') or "
        "m == 'torch.distributed.tensor'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("tokenizer_class", ["declared", "LlamaTokenizerFast", "undeclared"])
def test_the_tokenizer_is_the_one_autotokenizer_picks_alone(tmp_path, tokenizer_class):
    """AutoTokenizer is given the built config (sparing the class import) only where
    tokenizer_config.json names the tokenizer class; the tokenizer is the one it picks from the
    folder alone, either way."""
    from transformers import AutoTokenizer

    from llmhal.model_loader.checkpoint import SafetensorsCheckpoint
    from llmhal.model_loader.source import resolve_source
    from llmhal.testing.model_parity import tiny_config
    from llmhal.testing.tiny_models import make_tokenizer

    tiny_config("Qwen2ForCausalLM").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    make_tokenizer().save_pretrained(tmp_path)
    path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    if tokenizer_class == "undeclared":
        cfg.pop("tokenizer_class", None)
    elif tokenizer_class != "declared":
        cfg["tokenizer_class"] = tokenizer_class
    path.write_text(json.dumps(cfg))
    ours = SafetensorsCheckpoint(resolve_source(str(tmp_path))).tokenizer()
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(ours) is type(theirs)
    for text in ("Hello world", "ünïcödé 東京", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == theirs.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(
        chat, tokenize=False
    )
