"""EAGLE-3 drafting (vLLM's ``eagle3``; Li et al., 2025): the head reads three of the target's
layers (early, middle, late) fused by ``fc``, and has a small LM head over a draft vocabulary
mapped back to the target's.

Published layout (e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``, as safetensors): ``config.json`` a
Llama config with ``draft_vocab_size`` (and ``target_hidden_size`` where the target's differs),
optionally ``eagle_config.eagle_aux_hidden_state_layer_ids``; tensors ``fc.weight`` [H, 3H],
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}``, ``midlayer.self_attn.
{q,k,v}_proj`` over 2H inputs and ``o_proj``, ``midlayer.mlp.*``, ``norm.weight``, ``lm_head.weight``
[draft_vocab, H], ``d2t`` (draft id -> target id offset) and ``t2d`` (which target ids the draft
vocabulary holds); ``embed_tokens.weight`` where the head has its own, else the target's serves.

The target keeps the inputs of layers (2, L // 2, L - 3) by default (vLLM's choice; the ids in
``eagle_aux_hidden_state_layer_ids`` instead), through the model contract's
``set_aux_hidden_state_layers``. At position i the head's layer attends over
``[input_layernorm(embed(x[i+1])); hidden_norm(g)]`` with ``g = fc(taps[i])`` as its residual; on
later draft steps ``g`` is the head's own output. Its token is ``argmax(lm_head(norm(out)))`` mapped
through ``d2t`` (a tree's top-k ranks are taken over the draft vocabulary). Everything else
(per-request keys and values, positions, draft trees) is :mod:`.eagle`'s.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from llmhal.spec_decode.eagle import TREE_KEY, HeadProposer
from llmhal.spec_decode.head_layer import HeadLayer, rms_norm


class Eagle3Proposer(HeadProposer):
    config_keys: ClassVar[frozenset[str]] = frozenset({TREE_KEY})
    method_name: ClassVar[str] = "eagle3"
    display_name: ClassVar[str] = "EAGLE-3"

    def check_head(self) -> None:
        cfg, target = self.raw_cfg, self.target_cfg
        wanted = cfg.get("target_hidden_size") or cfg.get("hidden_size")
        if wanted != target.hidden_size:
            key = "target_hidden_size" if cfg.get("target_hidden_size") else "hidden_size"
            self._refuse(key, wanted, "hidden_size", target.hidden_size, "the head fuses the target's hidden states of that size")  # fmt: skip
        if cfg.get("vocab_size") != target.vocab_size:
            self._refuse("vocab_size", cfg.get("vocab_size"), "vocab_size", target.vocab_size, "its d2t map points into the target's vocabulary")  # fmt: skip
        if int(cfg.get("num_hidden_layers", 1)) != 1:
            raise ValueError(
                f"{self.folder}: EAGLE-3 heads with num_hidden_layers="
                f"{cfg.get('num_hidden_layers')} are not supported (the published heads have 1)"
            )
        n = target.num_hidden_layers
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        ids = ids or cfg.get("eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3)
        if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < n for i in ids):
            raise ValueError(
                f"EAGLE-3 reads the inputs of three target layers, {list(ids)} here, but the target "
                f"has {n} layers (0..{n - 1}); set eagle_config.eagle_aux_hidden_state_layer_ids "
                f"in {self.folder / 'config.json'} to the layers the head was trained on"
            )
        self.aux_layers = tuple(ids)

    def build(self) -> None:
        prefix = "midlayer." if any(k.startswith("midlayer.") for k in self.weights) else "layers.0."  # fmt: skip
        parts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "hidden_norm", "post_attention_layernorm")  # fmt: skip
        self._need(["fc.weight", "norm.weight", "lm_head.weight", *(f"{prefix}{p}.weight" for p in parts)])  # fmt: skip
        hidden = self.cfg.hidden_size
        fc = self.weights["fc.weight"]
        if tuple(fc.shape) != (hidden, 3 * self.target_cfg.hidden_size):
            raise ValueError(f"{self.folder}: fc.weight is {list(fc.shape)}, EAGLE-3 needs [{hidden}, 3 x {self.target_cfg.hidden_size}]")  # fmt: skip
        if "embed_tokens.weight" not in self.weights and hidden != self.target_cfg.hidden_size:
            raise ValueError(f"{self.folder}: the head has hidden_size {hidden} and no embed_tokens of its own; the target's embeddings are {self.target_cfg.hidden_size} wide")  # fmt: skip
        self.layers = [HeadLayer(self.weights, prefix, self.cfg, self.rope)]
        self.hidden_norm = self.weights[f"{prefix}hidden_norm.weight"]
        d2t = self.weights.get("d2t")
        draft_vocab = self.weights["lm_head.weight"].shape[0]
        if d2t is None and draft_vocab != self.target_cfg.vocab_size:
            raise ValueError(f"{self.folder}: lm_head has {draft_vocab} rows (a draft vocabulary) but there is no d2t map to the target's {self.target_cfg.vocab_size} tokens")  # fmt: skip
        self.d2t = None if d2t is None else d2t.long()

    def head_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        hidden = hidden.to(embeds.dtype)
        if hidden.shape[-1] != embeds.shape[-1]:  # the target's three layers: fuse them
            hidden = F.linear(hidden, self.weights["fc.weight"], self.weights.get("fc.bias"))
        layer = self.layers[0]
        normed = rms_norm(embeds, layer.input_norm, self.eps)
        return torch.cat([normed, rms_norm(hidden, self.hidden_norm, self.eps)], -1), hidden

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Over the draft vocabulary (see to_target)."""
        return F.linear(rms_norm(out, self.weights["norm.weight"], self.eps), self.weights["lm_head.weight"])  # fmt: skip

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.d2t is None else ids + self.d2t[ids]
