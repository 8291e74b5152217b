"""The ``Attention`` module that models use. It picks its backend at construction and reads the
step's metadata from the forward context; the engine binds its KV cache tensor after allocation."""

from __future__ import annotations

import torch
from torch import nn

from llmhal.attention.backend import AttentionRequirements
from llmhal.attention.selector import select_attention_backend
from llmhal.config import get_current_config
from llmhal.forward_context import get_forward_context


def _chose_recurrent_backend(explicit: str | None) -> bool:
    from llmhal.attention.registry import get_backend_entry
    from llmhal.attention.state import RECURRENT_KINDS, explicit_backend_choice

    choice = explicit_backend_choice(explicit)
    entry = get_backend_entry(choice) if choice else None
    return entry is not None and entry.kind in RECURRENT_KINDS


class Attention(nn.Module):
    """Paged attention over this layer's KV cache, through the selected backend."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        kind: str = "mha",
        prefix: str = "",
    ) -> None:
        super().__init__()
        cfg = get_current_config()
        if kind == "mha" and cfg.extra.get("draft_trees"):
            # The engine verifies speculative draft trees: its attention layers serve a tree mask
            # (a backend of kind "tree", which gives requests without a tree the causal rule).
            kind = "tree"
        num_kv_heads = num_kv_heads or num_heads
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.layer_name = prefix
        self.requirements = AttentionRequirements(
            head_size=head_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            dtype=cfg.model.dtype,
            kv_cache_dtype=cfg.cache.kv_cache_dtype,
            block_size=cfg.cache.block_size,
            kind=kind,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
        # A recurrent backend chosen for a hybrid model serves its recurrent layers; these layers
        # select by kind, and the runner refuses a choice that serves no layer at all.
        by_kind = _chose_recurrent_backend(cfg.attention_backend)
        self.selection = select_attention_backend(
            self.requirements,
            explicit=None if by_kind else cfg.attention_backend,
            ignore_explicit=by_kind,
        )
        self.backend = self.selection.backend
        self.impl = self.backend.get_impl_cls()(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            sliding_window=sliding_window,
            kv_cache_dtype=cfg.cache.kv_cache_dtype,
            logits_soft_cap=logits_soft_cap,
        )
        # fp8 KV cache scales (stored value * scale = real value); checkpoints may overwrite them.
        self.register_buffer("k_scale", torch.tensor(1.0, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.tensor(1.0, dtype=torch.float32), persistent=False)
        self.kv_cache = torch.empty(0)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        meta = ctx.attn_metadata[self.backend.name]
        n = query.shape[0]
        out = self.impl.forward(
            self,
            query.view(n, self.num_heads, self.head_size),
            key.view(n, self.num_kv_heads, self.head_size),
            value.view(n, self.num_kv_heads, self.head_size),
            self.kv_cache,
            meta,
        )
        return out.reshape(n, self.num_heads * self.head_size)
