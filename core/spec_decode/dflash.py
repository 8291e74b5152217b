"""DFlash drafting (``dflash``; z-lab's "DFlash: Block Diffusion for Flash Speculative Decoding"):
a small bidirectional transformer fills a whole block of masked positions in one forward pass,
conditioned on the target's hidden states, so k drafts cost one pass of the head instead of k.

Published layout (e.g. ``z-lab/Qwen3-8B-DFlash-b16``, safetensors): ``config.json`` a Qwen3-style
config with ``dflash_config`` = {``target_layer_ids``, ``block_size``, ``mask_token_id``} (and
optionally ``input_embedding_scale``, ``output_multiplier``, ``final_logit_softcapping``); tensors
``fc.weight`` [H, len(target_layer_ids) x H], ``hidden_norm.weight``, ``norm.weight``, and per layer
``layers.N.self_attn.{q,k,v,o}_proj`` with per-head ``q_norm``/``k_norm``, ``layers.N.mlp.*``,
``layers.N.{input,post_attention}_layernorm``. The target's embedding and LM head serve.

How it drafts, at a request with n tokens: the target's outputs of layers ``target_layer_ids`` (the
inputs of the layers after them, through ``set_aux_hidden_state_layers``) at the committed positions
become the context ``c = hidden_norm(fc(features))``; each head layer projects ``c`` with its own
k/v projections (kept per request: the context only grows) and runs the block ``[newest token,
mask, mask, ...]`` at positions n - 1 .. n - 2 + block_size, attending to the context and to the
whole block in both directions. ``argmax(lm_head(norm(out)))`` at block positions 1.. are the drafts.
The block's own keys are not kept. Drafts are at most ``block_size - 1`` a step.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from llmhal.spec_decode.eagle import HeadLayer, HeadProposer, _Seq, rms_norm
from llmhal.spec_decode.proposer import DraftRequest

_LAYER_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")  # fmt: skip


class DFlashProposer(HeadProposer):
    method_name: ClassVar[str] = "dflash"

    def _setting(self, name: str, default: Any = None) -> Any:
        own = self.raw_cfg.get("dflash_config") or {}
        return own.get(name, self.raw_cfg.get(name, default))

    def check_head(self) -> None:
        super().check_head()  # hidden_size and vocab_size: it reads the target's embedding
        where = self.folder / "config.json"
        if self.raw_cfg.get("candidate_selector") or self._setting("selector_rank") is not None:
            raise ValueError(f"{where} is a DFlash-2 head (candidate selector, convolutions), which llmhal does not implement; use a DFlash head")  # fmt: skip
        if any(t != "full_attention" for t in self.raw_cfg.get("layer_types") or []):
            raise ValueError(f"{where}: DFlash heads with sliding-window layers are not supported")
        n = self.target_cfg.num_hidden_layers
        ids = self._setting("target_layer_ids")
        if not ids or not all(isinstance(i, int) and 0 <= i < n - 1 for i in ids):
            raise ValueError(
                f"{where} must name the target layers the head reads in dflash_config."
                f"target_layer_ids (each 0..{n - 2}: this target has {n} layers), got {ids!r}"
            )
        self.aux_layers = tuple(i + 1 for i in ids)  # a layer's output is the next one's input
        self.block_size = int(self._setting("block_size", 16))
        mask = self._setting("mask_token_id")
        if not isinstance(mask, int) or not 0 <= mask < self.target_cfg.vocab_size:
            raise ValueError(f"{where} needs dflash_config.mask_token_id, a token id of the target's vocabulary, got {mask!r}")  # fmt: skip
        self.mask_token_id = mask
        k = self.config.num_speculative_tokens
        if k > self.block_size - 1:
            raise ValueError(
                f"speculative_config['num_speculative_tokens']={k}, but this DFlash head fills "
                f"blocks of {self.block_size} (at most {self.block_size - 1} drafts a step); use "
                f"num_speculative_tokens <= {self.block_size - 1}"
            )

    def load_model(self, target_model: Any) -> None:
        setter = getattr(target_model, "set_aux_hidden_state_layers", None)
        if setter is None:
            raise ValueError(f"speculative method 'dflash' needs the target to keep inner layers' hidden states; {type(target_model).__name__} does not implement set_aux_hidden_state_layers")  # fmt: skip
        setter(self.aux_layers)
        super().load_model(target_model)

    def build(self) -> None:
        n = int(getattr(self.cfg, "num_hidden_layers", 1))
        self._need(["fc.weight", "hidden_norm.weight", "norm.weight", *(f"layers.{i}.{p}.weight" for i in range(n) for p in _LAYER_PARTS)])  # fmt: skip
        fc = self.weights["fc.weight"]
        want = (self.cfg.hidden_size, len(self.aux_layers) * self.target_cfg.hidden_size)
        if tuple(fc.shape) != want:
            raise ValueError(f"{self.folder}: fc.weight is {list(fc.shape)}, expected {list(want)} for {len(self.aux_layers)} target layers")  # fmt: skip
        self.layers = [HeadLayer(self.weights, f"layers.{i}.", self.cfg, self.rope) for i in range(n)]  # fmt: skip
        self.causal = bool(self._setting("is_causal", False))
        self.embed_scale = float(self._setting("input_embedding_scale", 1.0))
        self.logit_scale = float(self._setting("output_multiplier", 1.0))
        self.softcap = self._setting("final_logit_softcapping")

    def _draft(self, r: DraftRequest) -> list[int]:
        seq = self._seqs.get(r.request_id)
        if seq is None or seq.pos != r.hidden_start:
            seq = self._empty()
            seq.pos = r.hidden_start
            self._seqs[r.request_id] = seq
        n = r.num_tokens
        if r.hidden_states is None or seq.pos + r.hidden_states.shape[0] != n - 1:
            return []
        w = self.weights
        ctx = rms_norm(F.linear(r.hidden_states.to(self.dtype), w["fc.weight"]), w["hidden_norm.weight"], self.eps)  # fmt: skip
        positions = torch.arange(seq.pos, n - 1, device=self.device)
        self._extend(seq, ctx, positions)
        seq.pos = n - 1
        limit = self.engine_config.model.max_model_len - (n - 1)  # the rotary table's end
        size = min(self.block_size, limit)
        if size < 2:
            return []
        newest = r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
        block = self.embed([newest] + [self.mask_token_id] * (size - 1)) * self.embed_scale
        pos = torch.arange(n - 1, n - 1 + size, device=self.device)
        for i, layer in enumerate(self.layers):
            attn_in = rms_norm(block, layer.input_norm, self.eps)
            block, _, _ = layer.forward(attn_in, block, pos, seq.keys[i], seq.values[i], causal=self.causal)  # fmt: skip
        logits = self.target.compute_logits(rms_norm(block[1:], w["norm.weight"], self.eps))
        logits = logits * self.logit_scale
        if self.softcap:
            logits = torch.tanh(logits / float(self.softcap)) * float(self.softcap)
        return logits.argmax(-1)[: r.max_draft].tolist()

    def _extend(self, seq: _Seq, ctx: torch.Tensor, positions: torch.Tensor) -> None:
        for i, layer in enumerate(self.layers):
            k, v = layer.kv(ctx, positions)
            seq.keys[i], seq.values[i] = torch.cat([seq.keys[i], k]), torch.cat([seq.values[i], v])
