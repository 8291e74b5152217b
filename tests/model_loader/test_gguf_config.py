"""A GGUF file's config is built without importing transformers' per-architecture config classes
(~1.7 s of the default model's load). Every field the engine reads, and the RoPE table and sliding
windows it derives, must equal what ``AutoConfig.for_model`` gives for the same fields."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmhal.model_loader.gguf_loader import config_for
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
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")  # transformers'
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("model_type", list(ARCHS))
def test_the_config_reads_as_transformers_own(model_type, variant):
    from transformers import AutoConfig

    fields = {**BASE, "architectures": [ARCHS[model_type]], **VARIANTS[variant]}
    if model_type == "qwen2":
        fields.pop("attention_bias", None)  # Qwen2 has no such field (its q/k/v always have bias)
    ours = config_for(model_type, dict(fields))
    theirs = AutoConfig.for_model(model_type, **dict(fields))
    assert_configs_read_alike(ours, theirs)
    assert ours.model_type == theirs.model_type
    # Every other field too, for model classes registered out of tree. Not compared: the RoPE
    # parameters' form (the table built from them is, above) and Qwen's layer_types, which
    # transformers derives from use_sliding_window and max_window_layers (as the engine does).
    form = {"rope_parameters", "rope_scaling", "rope_theta", "layer_types", "transformers_version"}
    mine = {k: v for k, v in ours.to_dict().items() if k not in form}
    other = {k: v for k, v in theirs.to_dict().items() if k not in form}
    assert mine == other


def test_loading_a_gguf_model_imports_no_config_class(tmp_path):
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
