"""Random draft heads for a target, in the published layouts, for ``llmhal bench spec``.

No trained EAGLE or Medusa head exists for the default model, so the benchmark measures what such
a method costs when its drafts fail: random weights (their drafts are almost never accepted) in
the layouts the proposers load, sized for the target (EAGLE: one decoder layer over
``fc([embedding; hidden])`` with the target's embedding and LM head; Medusa: residual blocks with
one shared LM head, ``original_lm_head``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

_STD = 0.02  # weights of this spread keep the activations of a 576-wide layer in range


def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * _STD).to(torch.bfloat16)


def random_eagle_head(folder: Path, target_cfg: Any, seed: int = 0) -> Path:
    """An EAGLE-1 head (``config.json`` + ``model.safetensors``) for ``target_cfg``."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = target_cfg.hidden_size, target_cfg.intermediate_size
    heads, kv = target_cfg.num_attention_heads, target_cfg.num_key_value_heads
    hd = getattr(target_cfg, "head_dim", None) or h // heads
    p = "layers.0."
    tensors = {
        "fc.weight": _rand(gen, h, 2 * h),
        "fc.bias": torch.zeros(h, dtype=torch.bfloat16),
        p + "self_attn.q_proj.weight": _rand(gen, heads * hd, h),
        p + "self_attn.k_proj.weight": _rand(gen, kv * hd, h),
        p + "self_attn.v_proj.weight": _rand(gen, kv * hd, h),
        p + "self_attn.o_proj.weight": _rand(gen, h, heads * hd),
        p + "mlp.gate_proj.weight": _rand(gen, inter, h),
        p + "mlp.up_proj.weight": _rand(gen, inter, h),
        p + "mlp.down_proj.weight": _rand(gen, h, inter),
        p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "rope_theta", "head_dim")  # fmt: skip
    cfg = {k: getattr(target_cfg, k) for k in keep if getattr(target_cfg, k, None) is not None}
    cfg |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1}
    return _save(folder, tensors, cfg)


def random_medusa_heads(folder: Path, target_cfg: Any, num_heads: int = 3, seed: int = 0) -> Path:
    """Medusa heads in vLLM's layout, one residual block each and one shared LM head."""
    gen = torch.Generator().manual_seed(seed)
    h, vocab = target_cfg.hidden_size, target_cfg.vocab_size
    tensors = {"lm_heads.0.weight": _rand(gen, vocab, h)}
    for i in range(num_heads):
        tensors[f"blocks.{i}.layers.0.weight"] = _rand(gen, h, h)
        tensors[f"blocks.{i}.layers.0.bias"] = torch.zeros(h, dtype=torch.bfloat16)
    cfg = {
        "num_heads": num_heads, "num_hidden_layers": 1, "hidden_size": h, "vocab_size": vocab,
        "medusa_fc_bias": True, "original_lm_head": True,
    }  # fmt: skip
    return _save(folder, tensors, cfg)


def _save(folder: Path, tensors: dict[str, torch.Tensor], cfg: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return folder
