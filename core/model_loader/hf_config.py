"""Configs of the built-in architectures without transformers' per-architecture config classes.

``from transformers import LlamaConfig`` (or ``AutoConfig`` resolving one) took ~1.6 s of a ~4-6 s
load: the class's module pulls in ``torch.distributed.tensor`` and sympy through
``transformers.activations``. The engine needs only the config's values, so for the architectures
llmhal builds itself, :func:`config_for` makes a bare ``PreTrainedConfig`` subclass carrying
those classes' defaults and the rules their ``__post_init__`` applies (head size, KV heads, Qwen's
sliding windows and layer types). Anything else (another ``model_type``, remote code) still goes
through ``AutoConfig``. ``tests/model_loader/test_hf_config.py`` checks every field of
``to_dict()``, and the RoPE table and sliding windows the engine derives, against transformers'
own classes, for GGUF-style field sets and for ``save_pretrained`` config.json files.
"""

from __future__ import annotations

import functools
from typing import Any

_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "initializer_range": 0.02,
           "use_cache": True, "attention_dropout": 0.0, "tie_word_embeddings": False,
           "pad_token_id": None}  # fmt: skip
_QWEN = {**_COMMON, "max_position_embeddings": 32768, "num_key_value_heads": 32,
         "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
         "layer_types": None, "bos_token_id": None, "eos_token_id": None}  # fmt: skip
# The class defaults of LlamaConfig, MistralConfig, Qwen2Config and Qwen3Config (transformers 5)
# for the fields a checkpoint may leave out.
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "max_position_embeddings": 2048, "num_key_value_heads": None,
              "head_dim": None, "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
              "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {**_COMMON, "max_position_embeddings": 131072, "num_key_value_heads": 8,
                "head_dim": None, "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2": _QWEN,
    "qwen3": {**_QWEN, "attention_bias": False, "head_dim": 128},
}  # fmt: skip


def config_for(model_type: str, fields: dict[str, Any]) -> Any:
    """A ``PreTrainedConfig`` for ``model_type`` (one of :data:`DEFAULTS`) with ``fields`` over
    that architecture's defaults: what transformers' own class gives for them."""
    fields = {**DEFAULTS[model_type], **fields}
    fields.pop("model_type", None)
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if model_type in ("llama", "mistral") and fields["head_dim"] is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if model_type in ("qwen2", "qwen3"):
        if not fields["use_sliding_window"]:
            fields["sliding_window"] = None
        if fields["layer_types"] is None:
            first = fields["max_window_layers"]
            fields["layer_types"] = [
                "sliding_attention"
                if fields["sliding_window"] is not None and i >= first
                else "full_attention"
                for i in range(fields["num_hidden_layers"])
            ]
    scaling = fields.pop("rope_scaling", None)
    if scaling is not None and "rope_parameters" not in fields:
        # transformers 5's form (the old one is a FutureWarning there)
        theta = fields.pop("rope_theta", None) or 10000.0
        fields["rope_parameters"] = {**scaling, "rope_theta": theta}
    config = _config_class(model_type)(**fields)
    for name, value in fields.items():  # what the base class sets aside (use_cache)
        if name not in vars(config):
            setattr(config, name, value)
    if isinstance(getattr(config, "dtype", None), str):  # "bfloat16" -> torch.bfloat16, as there
        import torch

        if isinstance(getattr(torch, config.dtype, None), torch.dtype):
            config.dtype = getattr(torch, config.dtype)
    return config


def built_here(config: Any) -> bool:
    """Whether ``config`` came from :func:`config_for` (not from transformers' own class)."""
    return type(config).__module__ == __name__


@functools.cache
def _config_class(model_type: str) -> type:
    """A bare ``PreTrainedConfig`` subclass named for ``model_type`` (its ``to_dict`` and
    ``model_type`` read as the architecture's own class's do)."""
    from transformers.configuration_utils import PreTrainedConfig

    name = f"Light{model_type.capitalize()}Config"
    return type(name, (PreTrainedConfig,), {"model_type": model_type, "__module__": __name__})
