"""Medusa (vLLM's ``medusa``): extra decoding heads on the target's last hidden state guess the
tokens after the next one, and their top-k choices form a draft tree verified in one forward.

Head ``h`` maps the hidden state that produced the newest token to logits for the token ``h + 1``
places after it: residual blocks (``x + SiLU(Linear(x))``, ``num_hidden_layers`` of them) then an
LM head. The heads live in their own folder (``speculative_config["model"]``), in vLLM's layout:
``config.json`` with ``num_heads`` and ``num_hidden_layers`` (or Medusa's ``medusa_num_heads`` /
``medusa_num_layers``), ``hidden_size`` and ``vocab_size``; safetensors with
``blocks.<h>.layers.<l>.weight`` (``.bias`` when ``medusa_fc_bias``) and ``lm_heads.<h>.weight``
(a ``medusa_heads.`` prefix is accepted; with ``original_lm_head`` the one ``lm_heads.0.weight``
serves every head).

The draft may be a tree (see :mod:`llmhal.spec_decode.tree_verify`): node path ``(r1, .., rd)``
holds head ``d - 1``'s rank-``rd`` token. The shape is ``medusa_choices`` in the speculative config
(a list of rank paths, as in the Medusa repository, e.g. :func:`default_tree`); without it the
heads draft the top-1 chain (vLLM's behaviour), verified on the model's own attention backend. A request that cannot
take the whole tree (``max_tokens`` or the context near, a structured-output grammar) drafts the
top-1 chain instead.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from llmhal.spec_decode.proposer import DraftRequest, Proposer
from llmhal.spec_decode.tree_verify import (
    DraftTree,
    TreeDraft,
    check_tree_depth,
    check_tree_ranks,
    parse_token_tree,
)


class ResidualBlock(nn.Module):
    """``x + SiLU(Linear(x))``, ``num_layers`` times (checkpoint names ``layers.<l>.*``)."""

    def __init__(self, hidden: int, num_layers: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=bias) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + nn.functional.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int, bias: bool, shared_head: bool) -> None:  # fmt: skip
        super().__init__()
        self.blocks = nn.ModuleList(
            ResidualBlock(hidden, num_layers, bias) for _ in range(num_heads)
        )
        n_heads = 1 if shared_head else num_heads
        self.lm_heads = nn.ModuleList(nn.Linear(hidden, vocab, bias=False) for _ in range(n_heads))
        self.num_heads = num_heads

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [heads, rows, vocab] for ``hidden`` [rows, hidden_size]."""
        last = len(self.lm_heads) - 1  # one shared LM head (original_lm_head) or one per head
        return torch.stack([self.lm_heads[min(h, last)](b(hidden)) for h, b in enumerate(self.blocks)])  # fmt: skip


def read_medusa_config(folder: str) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(
            f"speculative_config['model']={folder!r} has no config.json: give the folder holding "
            "the Medusa heads (config.json and safetensors in vLLM's layout)"
        )
    raw = json.loads(path.read_text(encoding="utf-8"))
    heads = raw.get("num_heads", raw.get("medusa_num_heads"))
    layers = raw.get("num_hidden_layers", raw.get("medusa_num_layers", 1))
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"{path} needs 'num_heads' (or 'medusa_num_heads'), a positive integer")
    return {**raw, "num_heads": heads, "num_hidden_layers": int(layers)}


class MedusaProposer(Proposer):
    config_keys: ClassVar[frozenset[str]] = frozenset({"medusa_choices"})
    uses_target_hidden_states: ClassVar[bool] = True

    @classmethod
    def check_config(cls, config: Any) -> None:
        if not config.model:
            raise ValueError(
                "speculative_config method 'medusa' needs 'model': the folder of the Medusa heads"
            )
        choices = cls._choices(config.extra)
        if choices is not None:
            check_tree_depth(choices, config.num_speculative_tokens, "medusa_choices")

    @staticmethod
    def _choices(extra: dict[str, Any]) -> list[tuple[int, ...]] | None:
        """``medusa_choices`` checked as the EAGLE trees are (a list of rank paths, or a string
        holding one), except that a path's prefixes need not be listed: Medusa adds them."""
        value = extra.get("medusa_choices")
        return None if value is None else parse_token_tree(value, "medusa_choices", prefix_closed=False)  # fmt: skip

    def __init__(self, config: Any, engine_config: Any) -> None:
        super().__init__(config, engine_config)
        self.head_config = cfg = read_medusa_config(config.model)
        target = engine_config.model.hf_config
        for key in ("hidden_size", "vocab_size"):
            if key in cfg and cfg[key] != getattr(target, key, None):
                raise ValueError(
                    f"the Medusa heads in {config.model} have {key}={cfg[key]}, the target "
                    f"{getattr(target, key, None)}: use heads trained for this model"
                )
        if cfg.get("truncated_vocab_size", cfg.get("vocab_size")) != cfg.get("vocab_size"):
            raise ValueError(
                f"the Medusa heads in {config.model} use a truncated vocabulary (token_map), "
                "which llmhal does not support; use heads over the whole vocabulary"
            )
        k = config.num_speculative_tokens
        if k > cfg["num_heads"]:
            raise ValueError(
                f"speculative_config['num_speculative_tokens']={k} but the Medusa checkpoint has "
                f"{cfg['num_heads']} heads (one per draft position); use at most {cfg['num_heads']}"
            )
        # A chain unless asked for a tree: tree steps go through tree_attn, whose float32 einsums
        # round differently from the platform's decode kernel, which in bf16 can flip a near-tie
        # (the default model drifted from plain decoding); the chain stays on the model's backend.
        choices = self._choices(config.extra) or [(0,) * d for d in range(1, k + 1)]
        vocab = engine_config.model.hf_config.vocab_size
        check_tree_ranks(choices, vocab, "medusa_choices", "each Medusa head")
        self.tree, self.ranks = DraftTree.from_paths(choices)
        self.top_k = 1 + max(r for path in self.ranks for r in path)
        self.heads: MedusaHeads | None = None

    @property
    def drafts_trees(self) -> bool:
        """Whether the drafts branch (the engine then verifies through ``tree_attn``)."""
        return not self.tree.is_chain

    def load_model(self, target_model: Any) -> None:
        from llmhal.model_loader.safetensors_loader import iter_safetensors_weights

        cfg = self.head_config
        weights = {
            n.removeprefix("medusa_heads."): t
            for n, t in iter_safetensors_weights(self.config.model, progress=False)
        }
        bias = bool(cfg.get("medusa_fc_bias", any(n.endswith(".bias") for n in weights)))
        shared = bool(cfg.get("original_lm_head", False))
        target_cfg = self.engine_config.model.hf_config
        heads = MedusaHeads(
            target_cfg.hidden_size, target_cfg.vocab_size, cfg["num_heads"],
            cfg["num_hidden_layers"], bias, shared,
        )  # fmt: skip
        params = dict(heads.named_parameters())
        missing = sorted(set(params) - set(weights))
        if missing:
            raise ValueError(
                f"the Medusa checkpoint in {self.config.model} lacks {', '.join(missing[:4])}"
                f"{' ...' if len(missing) > 4 else ''} (vLLM's layout: blocks.<h>.layers.<l>.weight, "
                "lm_heads.<h>.weight)"
            )
        with torch.no_grad():
            for name, p in params.items():
                w = weights[name]
                if tuple(w.shape) != tuple(p.shape):
                    raise ValueError(
                        f"Medusa weight {name} has shape {tuple(w.shape)}, expected {tuple(p.shape)}"
                    )
                p.copy_(w)
        dev = next(target_model.parameters()).device
        self.heads = heads.to(device=dev, dtype=self.engine_config.model.dtype).eval()

    def memory_bytes(self) -> int:
        if self.heads is None:
            return 0
        return sum(p.numel() * p.element_size() for p in self.heads.parameters())

    def propose(self, requests: Sequence[DraftRequest]) -> list[Any]:
        assert self.heads is not None, "load_model() was not called"
        # The hidden state that produced each request's newest token: the last row handed over.
        ready = [
            i for i, r in enumerate(requests) if r.hidden_reaches_newest and len(r.hidden_states)
        ]
        out: list[Any] = [[] for _ in requests]
        if not ready:
            return out
        last = torch.stack([requests[i].hidden_states[-1] for i in ready])
        logits = self.heads(last.to(self.heads.lm_heads[0].weight.dtype))
        top = logits.topk(self.top_k, dim=-1).indices.tolist()  # [heads][rows][k]
        tree = self.tree
        for row, i in enumerate(ready):
            if tree.is_chain or tree.depth > requests[i].max_draft:
                out[i] = [top[h][row][0] for h in range(requests[i].max_draft)]
            else:
                out[i] = TreeDraft([top[len(path) - 1][row][path[-1]] for path in self.ranks], tree)
        return out
