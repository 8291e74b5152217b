"""What the engine reads from a transformers config, for checking two configs read alike.

llmhal builds some configs itself (a GGUF file's, without importing transformers' per-architecture
classes); :func:`assert_configs_read_alike` checks such a config against transformers' own for the
same model: every attribute the engine and the built-in models read, the head size they derive,
each layer's sliding window and the RoPE table, value for value.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

# Every hf_config attribute the engine and the built-in models read (as attributes or getattr).
ENGINE_CONFIG_FIELDS = (
    "architectures", "hidden_size", "num_hidden_layers", "intermediate_size",
    "num_attention_heads", "num_key_value_heads", "vocab_size", "hidden_act", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "bos_token_id", "eos_token_id", "pad_token_id", "partial_rotary_factor", "dtype",
    "quantization_config",
)  # fmt: skip


def head_dim(config: Any) -> int:
    """The models' rule: ``head_dim`` when set, else hidden size over heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def assert_configs_read_alike(ours: Any, theirs: Any, skip: Collection[str] = ()) -> None:
    """Raise AssertionError naming the first field that reads differently; ``skip`` names fields
    (or ``head_dim``, which also skips the RoPE table built with it) not to compare."""
    import torch

    from llmhal.layers.rotary_embedding import get_rope_from_hf_config
    from llmhal.models.utils import layer_sliding_window

    for name in ENGINE_CONFIG_FIELDS:
        if name not in skip:
            mine, other = getattr(ours, name, None), getattr(theirs, name, None)
            assert mine == other, f"{name}: {mine!r} != {other!r}"
    for layer in range(theirs.num_hidden_layers):
        mine, other = layer_sliding_window(ours, layer), layer_sliding_window(theirs, layer)
        assert mine == other, f"layer {layer}'s sliding window: {mine} != {other}"
    if "head_dim" in skip:
        return
    assert head_dim(ours) == head_dim(theirs), f"head_dim: {head_dim(ours)} != {head_dim(theirs)}"
    ropes = [get_rope_from_hf_config(c, head_dim(c), dtype=torch.float32) for c in (ours, theirs)]
    assert ropes[0].rotary_dim == ropes[1].rotary_dim, "rotary_dim"
    assert torch.equal(ropes[0].cos_sin_cache, ropes[1].cos_sin_cache), "the RoPE table"
