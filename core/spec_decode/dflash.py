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

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from llmhal.spec_decode.eagle import HeadProposer
from llmhal.spec_decode.head_layer import HeadLayer, rms_norm
from llmhal.spec_decode.proposer import DraftRequest

_LAYER_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")  # fmt: skip


class DFlashProposer(HeadProposer):
    method_name: ClassVar[str] = "dflash"
    display_name: ClassVar[str] = "DFlash"

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

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """The new context of every request projected at once, then every request's block in
        one pass of the head."""
        drafts: list[list[int]] = [[] for _ in requests]
        todo = [(i, r, self._seq(r)) for i, r in enumerate(requests)]
        todo = [(i, r, s) for i, r, s in todo if s is not None]
        if not todo:
            return drafts
        w = self.weights
        feats = torch.cat([r.hidden_states for _, r, _ in todo]).to(self.dtype)
        ctx = rms_norm(F.linear(feats, w["fc.weight"]), w["hidden_norm.weight"], self.eps)
        positions = torch.cat([torch.arange(s.pos, r.num_tokens - 1) for _, r, s in todo])
        lens = [r.num_tokens - 1 - s.pos for _, r, s in todo]
        for li, layer in enumerate(self.layers):
            ks, vs = layer.kv(ctx, positions.to(self.device))
            for (_, _, s), k, v in zip(todo, ks.split(lens), vs.split(lens), strict=True):
                s.keys[li], s.values[li] = torch.cat([s.keys[li], k]), torch.cat([s.values[li], v])
        for _, r, s in todo:
            s.pos = r.num_tokens - 1
        # Blocks end at the rotary table's end (max_model_len).
        limit = self.engine_config.model.max_model_len
        sizes = [min(self.block_size, limit - s.pos) for _, _, s in todo]
        fits = [m for m, n in enumerate(sizes) if n > 1]
        todo, sizes = [todo[m] for m in fits], [sizes[m] for m in fits]
        if not todo:
            return drafts
        ids: list[int] = []
        for (_, r, _), n in zip(todo, sizes, strict=True):
            newest = r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
            ids += [newest] + [self.mask_token_id] * (n - 1)
        block = self.embed(ids) * self.embed_scale
        pos = torch.cat([torch.arange(s.pos, s.pos + n) for (_, _, s), n in zip(todo, sizes, strict=True)])  # fmt: skip
        pos = pos.to(self.device)
        for li, layer in enumerate(self.layers):
            attn_in = rms_norm(block, layer.input_norm, self.eps)
            kv = [(s.keys[li], s.values[li]) for _, _, s in todo]
            block, _, _ = layer.forward(attn_in, block, pos, kv, sizes, causal=self.causal)
        # Every block's positions after its first (the newest token) are drafts.
        starts = torch.tensor([0, *sizes[:-1]]).cumsum(0)
        rows = torch.cat([torch.arange(a + 1, a + n) for a, n in zip(starts.tolist(), sizes, strict=True)])  # fmt: skip
        logits = self.target.compute_logits(rms_norm(block[rows.to(self.device)], w["norm.weight"], self.eps))  # fmt: skip
        logits = logits * self.logit_scale
        if self.softcap:
            logits = torch.tanh(logits / float(self.softcap)) * float(self.softcap)
        best = logits.argmax(-1).tolist()
        at = 0
        for (i, r, _), n in zip(todo, sizes, strict=True):
            drafts[i] = best[at : at + n - 1][: r.max_draft]
            at += n - 1
        return drafts
