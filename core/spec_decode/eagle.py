"""EAGLE drafting (vLLM's ``eagle``; Li et al., 2024): a small head predicts the target's next
hidden state from its current one and the next token's embedding; an LM head turns that into a
draft token, and the draft's own output feeds the next draft step.

Published layout (e.g. ``yuhuili/EAGLE-LLaMA3-Instruct-8B``, as safetensors): ``config.json`` is a
Llama config (``hidden_size``, heads, ``num_hidden_layers`` 1, ``rms_norm_eps``, RoPE), tensors
``fc.weight`` [H, 2H] (``fc.bias`` where it was trained with one), per layer ``layers.N.self_attn.
{q,k,v,o}_proj``, ``layers.N.mlp.{gate,up,down}_proj``, ``layers.N.post_attention_layernorm``, and
``layers.N.input_layernorm`` for layers after the first (the first takes fc's output as it is).
``embed_tokens.weight`` / ``lm_head.weight`` where the head has its own; otherwise the target's
embedding and LM head serve. The head's input at position i is ``fc([embed(x[i+1]); h[i]])``, ``h[i]``
the target's last hidden state (after its final norm) at i, so its output at the newest position
predicts the token after the newest one; positions are the target's.

The head keeps keys and values per request in the proposer (dense tensors, one head's layers): the
target's hidden states arrive with each call for the positions committed since the previous one, so
a call computes those plus one position per further draft. Drafts are the head's argmax (one-hot
for the rejection sampler, which keeps the output lossless whatever the head), or, with
``speculative_token_tree`` (vLLM's key: rank paths such as ``"[(0,), (1,), (0, 0)]"``), a tree of
the head's top-k choices drafted level by level and verified in one target forward through
``tree_attn`` (:mod:`.tree_verify`). :class:`HeadProposer` here and the head's layer
(:mod:`.head_layer`) are shared with EAGLE-3 (:mod:`.eagle3`) and DFlash (:mod:`.dflash`).
"""

from __future__ import annotations

import json
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from llmhal.spec_decode.head_layer import ACTIVATIONS, HeadLayer, rms_norm
from llmhal.spec_decode.proposer import DraftRequest, Proposer
from llmhal.spec_decode.tree_verify import (
    DraftTree,
    TreeDraft,
    check_tree_depth,
    check_tree_ranks,
    parse_token_tree,
)

# vLLM's key for a draft tree's shape (rank paths), taken by EAGLE and EAGLE-3.
TREE_KEY = "speculative_token_tree"


@dataclass(frozen=True)
class _Level:
    """One depth of a draft tree, for drafting it level by level. ``nodes``: the tree's nodes at
    this depth, each with its parent as an index into the previous level's ``expand`` (0: the
    root) and its rank among the parent's ``k`` likeliest tokens. ``expand``: this depth's nodes
    that have children (run through the head), with their parents' indices and ``mask``, bool
    [len(expand), rows run before + len(expand)]: which draft rows each sees (its ancestors and
    itself)."""

    depth: int
    nodes: list[int]
    parent_slots: list[int]
    ranks: list[int]
    k: int
    expand: list[int]
    expand_parent_slots: list[int]
    mask: torch.Tensor


def _tree_levels(tree: DraftTree, ranks: Sequence[tuple[int, ...]]) -> list[_Level]:
    levels = []
    parents = [0]  # the previous level's nodes with children, in the order they ran
    ran: list[int] = []  # every node run through the head before this level, in order
    for d in range(1, tree.depth + 1):
        nodes = [i for i in range(1, tree.num_nodes + 1) if tree.depths[i] == d]
        slot = {p: j for j, p in enumerate(parents)}
        expand = [i for i in nodes if tree.children[i]]
        node_ranks = [ranks[i - 1][-1] for i in nodes]
        mask = tree.mask[expand][:, ran + expand] if expand else tree.mask[:0, :0]
        levels.append(_Level(
            d, nodes, [slot[tree.parents[i - 1]] for i in nodes], node_ranks, 1 + max(node_ranks),
            expand, [slot[tree.parents[i - 1]] for i in expand], mask,
        ))  # fmt: skip
        ran += expand
        parents = expand
    return levels


@dataclass
class _Seq:
    """A request's head state: keys and values per layer for positions ``start .. pos - 1``."""

    pos: int
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)


class HeadProposer(Proposer):
    """Drafting with a head that reads the target's hidden states (EAGLE, EAGLE-3): the head's
    checkpoint (``speculative_config["model"]``, a folder with config.json and safetensors) is
    checked against the target before anything loads, and loaded beside it in ``load_model``.
    Subclasses say how the head's input is formed (:meth:`head_input`) and how its output becomes
    tokens (:meth:`logits`, :meth:`to_target`)."""

    uses_target_hidden_states: ClassVar[bool] = True
    method_name: ClassVar[str] = "eagle"
    display_name: ClassVar[str] = "EAGLE"
    # The target layers whose inputs the head reads (EAGLE-3, DFlash: set by check_head); empty:
    # the target's last hidden state (EAGLE).
    aux_layers: tuple[int, ...] = ()

    @classmethod
    def check_config(cls, config: Any) -> None:
        if not config.model:
            raise ValueError(
                f"speculative_config method {cls.method_name!r} needs 'model': the folder of the "
                "head's checkpoint (config.json and .safetensors, as published)"
            )
        paths = cls._tree_paths(config.extra)
        if paths:
            check_tree_depth(paths, config.num_speculative_tokens, TREE_KEY)

    @classmethod
    def num_speculative_tokens_from(cls, raw: dict[str, Any]) -> int | None:
        """A tree's depth, where the config gives a tree and no ``num_speculative_tokens``."""
        paths = cls._tree_paths(raw)
        return max(map(len, paths)) if paths else None

    @classmethod
    def _tree_paths(cls, d: dict[str, Any]) -> list[tuple[int, ...]] | None:
        if TREE_KEY not in cls.config_keys or d.get(TREE_KEY) is None:
            return None
        return parse_token_tree(d[TREE_KEY], TREE_KEY)

    def __init__(self, config: Any, engine_config: Any) -> None:
        super().__init__(config, engine_config)
        folder = Path(config.model).expanduser()
        cfg_file = folder / "config.json"
        if not cfg_file.is_file():
            raise ValueError(
                f"speculative_config['model']={config.model!r} has no config.json: give the folder "
                f"of a published {self.display_name} head (config.json and .safetensors)"
            )
        self.folder = folder
        self.raw_cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        self.cfg = types.SimpleNamespace(**self.raw_cfg)
        self.target_cfg = engine_config.model.hf_config
        act = getattr(self.cfg, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"{cfg_file}: hidden_act {act!r} is not supported; heads with {', '.join(ACTIVATIONS)} are")  # fmt: skip
        self.check_head()
        # The draft tree's shape (None: the argmax chain, num_speculative_tokens long).
        paths = self._tree_paths(config.extra)
        self.tree: DraftTree | None = None
        if paths is not None:
            vocab = getattr(self.cfg, "draft_vocab_size", None) or self.target_cfg.vocab_size
            check_tree_ranks(paths, vocab, TREE_KEY, f"the {self.display_name} head")
            self.tree, ranks = DraftTree.from_paths(paths)
            self._levels = _tree_levels(self.tree, ranks)
        self._seqs: dict[str, _Seq] = {}
        self.layers: list[HeadLayer] = []
        self.weights: dict[str, torch.Tensor] = {}

    # ----------------------------------------------------------------- checks and loading
    def _refuse(self, key: str, value: Any, target_key: str, target_value: Any, why: str) -> None:
        raise ValueError(
            f"the {self.display_name} head speculative_config['model']={self.config.model!r} has "
            f"{key}={value}, but the target's {target_key} is {target_value}: {why}; use the "
            "head published for this target model"
        )

    def check_head(self) -> None:
        """Refuse a head that cannot run on this target (before anything loads)."""
        for key in ("hidden_size", "vocab_size"):
            mine, theirs = getattr(self.cfg, key, None), getattr(self.target_cfg, key, None)
            if mine != theirs:
                self._refuse(key, mine, key, theirs, "the head reads the target's hidden states and shares its embedding and LM head")  # fmt: skip

    def _read_weights(self, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        from llmhal.model_loader.safetensors_loader import iter_safetensors_weights

        if not any(self.folder.glob("*.safetensors")):
            raise ValueError(
                f"{self.folder} has no .safetensors file; llmhal loads heads from safetensors "
                "(convert a pytorch_model.bin with safetensors.torch.save_file)"
            )
        out = {}
        for name, t in iter_safetensors_weights(self.folder, progress=False):
            # Some conversions keep the training wrapper's prefix.
            name = name.removeprefix("model.")
            keep = t.dtype if not t.is_floating_point() else dtype  # vocab maps stay integers
            out[name] = t.to(device=device, dtype=keep)
        return out

    def _need(self, names: Sequence[str]) -> None:
        missing = [n for n in names if n not in self.weights]
        if missing:
            raise ValueError(
                f"{self.folder} is not a {self.display_name} head in the published layout: "
                f"missing {', '.join(missing)}"
            )

    def load_model(self, target_model: Any) -> None:
        from llmhal.layers.rotary_embedding import get_rope_from_hf_config

        if self.aux_layers:
            setter = getattr(target_model, "set_aux_hidden_state_layers", None)
            if setter is None:
                raise ValueError(
                    f"speculative method {self.method_name!r} needs the target to keep inner "
                    f"layers' hidden states, and {type(target_model).__name__} does not implement "
                    "set_aux_hidden_state_layers; use 'eagle' or a Llama-family target"
                )
            setter(self.aux_layers)
        param = next(target_model.parameters())
        self.device, self.dtype = param.device, self.engine_config.model.dtype
        self.target = target_model
        self.weights = self._read_weights(self.device, self.dtype)
        if "embed_tokens.weight" not in self.weights and not hasattr(target_model, "embed_input_ids"):  # fmt: skip
            raise ValueError(
                f"the {self.display_name} head in {self.folder} has no embed_tokens of its own and "
                f"{type(target_model).__name__} does not expose embed_input_ids to share its own"
            )
        cfg = self.cfg
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if not hasattr(cfg, "max_position_embeddings"):
            cfg.max_position_embeddings = self.engine_config.model.max_model_len
        self.rope = get_rope_from_hf_config(cfg, head_dim, max_position=self.engine_config.model.max_model_len, dtype=torch.float32)  # fmt: skip
        self.rope = self.rope.to(self.device)
        self.eps = cfg.rms_norm_eps
        self.build()

    def build(self) -> None:
        """EAGLE: fc and the decoder layers (the first without an input norm)."""
        n = int(getattr(self.cfg, "num_hidden_layers", 1))
        names = ["fc.weight"]
        for i in range(n):
            names += [f"layers.{i}.{p}.weight" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm")]  # fmt: skip
        self._need(names)
        self.layers = [HeadLayer(self.weights, f"layers.{i}.", self.cfg, self.rope) for i in range(n)]  # fmt: skip

    @property
    def drafts_trees(self) -> bool:
        """Whether the drafts branch (the engine then verifies them through ``tree_attn``)."""
        return self.tree is not None and not self.tree.is_chain

    def memory_bytes(self) -> int:
        tensors = list(self.weights.values())
        for s in self._seqs.values():
            tensors += s.keys + s.values
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------------ the head
    def embed(self, ids: list[int]) -> torch.Tensor:
        t = torch.tensor(ids, dtype=torch.long, device=self.device)
        own = self.weights.get("embed_tokens.weight")
        return F.embedding(t, own) if own is not None else self.target.embed_input_ids(t)

    def head_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The first layer's attention input and residual from the next tokens' embeddings and
        the hidden states (the target's, or the head's own output on later draft steps)."""
        x = F.linear(torch.cat([embeds, hidden.to(embeds.dtype)], -1), self.weights["fc.weight"], self.weights.get("fc.bias"))  # fmt: skip
        return x, x

    def run(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, seqs: Sequence[_Seq], lens: Sequence[int], masks: Sequence[torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        """The head over new rows of several requests (``lens[i]`` rows of ``seqs[i]``, in
        order, causal unless ``masks`` says what each row sees: see HeadLayer.forward); appends
        their keys and values to each one's."""
        attn_in, x = self.head_input(embeds, hidden)
        for i, layer in enumerate(self.layers):
            if i:
                attn_in = x if layer.input_norm is None else rms_norm(x, layer.input_norm, self.eps)
            kv = [(s.keys[i], s.values[i]) for s in seqs]
            x, ks, vs = layer.forward(attn_in, x, positions, kv, lens, masks=masks)
            for s, k, v in zip(seqs, ks, vs, strict=True):
                s.keys[i], s.values[i] = torch.cat([s.keys[i], k]), torch.cat([s.values[i], v])
        return x

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The head's logits for each row of its output: EAGLE feeds the un-normed output to the
        LM head (its own, else the target's)."""
        own = self.weights.get("lm_head.weight")
        return F.linear(out, own) if own is not None else self.target.compute_logits(out)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of ids in the head's vocabulary (EAGLE's is the target's)."""
        return ids

    def top_tokens(self, out: torch.Tensor, k: int = 1) -> torch.Tensor:
        """Each row's ``k`` likeliest draft tokens, likeliest first, as target ids ([rows, k] on
        the CPU); k = 1 is the argmax."""
        logits = self.logits(out)
        ids = logits.argmax(-1, keepdim=True) if k == 1 else logits.topk(k, -1).indices
        return self.to_target(ids).cpu()

    # ----------------------------------------------------------------------- drafting
    def _empty(self) -> _Seq:
        layers = self.layers
        shape = [(0, layer.kv_heads, layer.dim) for layer in layers]
        return _Seq(0, [torch.empty(s, dtype=self.dtype, device=self.device) for s in shape], [torch.empty(s, dtype=self.dtype, device=self.device) for s in shape])  # fmt: skip

    def propose(self, requests: Sequence[DraftRequest]) -> list[Any]:
        """Every request's new positions through the head together, then the drafts from there:
        the configured tree (:meth:`_draft_tree`), else (and for a request too near its end for
        the whole tree) the argmax chain (:meth:`_draft_chain`)."""
        drafts: list[Any] = [[] for _ in requests]
        todo = [(i, r, self._seq(r)) for i, r in enumerate(requests)]
        todo = [(i, r, s) for i, r, s in todo if s is not None]
        if not todo:
            return drafts
        tokens: list[int] = []
        positions: list[torch.Tensor] = []
        for _, r, s in todo:
            # The head pairs h[p] with the token after it: tokens s.pos + 1 .. n - 1.
            a, plen = s.pos + 1, len(r.prompt_token_ids)
            tokens += [*r.prompt_token_ids[a:], *r.output_token_ids[max(0, a - plen) :]]
            positions.append(torch.arange(s.pos, r.num_tokens - 1))
        lens = [r.num_tokens - 1 - s.pos for _, r, s in todo]
        hidden = torch.cat([r.hidden_states for _, r, _ in todo])
        out = self.run(self.embed(tokens), hidden, torch.cat(positions).to(self.device), [s for *_, s in todo], lens)  # fmt: skip
        last = out[torch.tensor(lens).cumsum(0) - 1]
        # Keys and values of draft positions go to copies: the next call starts from the
        # committed ones.
        live = []
        for _, r, s in todo:
            s.pos = r.num_tokens - 1
            live.append(_Seq(s.pos, list(s.keys), list(s.values)))
        tree = self.tree
        whole = [self.drafts_trees and tree is not None and tree.depth <= r.max_draft for _, r, _ in todo]  # fmt: skip
        for want, draft in ((False, self._draft_chain), (True, self._draft_tree)):
            group = [m for m, w in enumerate(whole) if w == want]
            if group:
                draft([todo[m] for m in group], last[group], [live[m] for m in group], drafts)
        return drafts

    def _draft_chain(self, todo: list[Any], last: torch.Tensor, live: list[_Seq], drafts: list[Any]) -> None:  # fmt: skip
        """The argmax chain: one batched head step per further draft for the requests that still
        want one (at most the tree's depth where a tree is configured)."""
        limit = self.tree.depth if self.tree is not None else self.config.num_speculative_tokens
        for j in range(max(min(r.max_draft, limit) for _, r, _ in todo)):
            new = self.top_tokens(last)[:, 0].tolist()
            for (i, _, _), t in zip(todo, new, strict=True):
                drafts[i].append(t)
            keep = [m for m, (i, r, _) in enumerate(todo) if len(drafts[i]) < min(r.max_draft, limit)]  # fmt: skip
            if not keep:
                break
            todo, live = [todo[m] for m in keep], [live[m] for m in keep]
            pos = torch.tensor([r.num_tokens - 1 + j for _, r, _ in todo], device=self.device)
            last = self.run(self.embed([drafts[i][-1] for i, _, _ in todo]), last[keep], pos, live, [1] * len(todo))  # fmt: skip

    def _draft_tree(self, todo: list[Any], last: torch.Tensor, live: list[_Seq], drafts: list[Any]) -> None:  # fmt: skip
        """The configured tree, level by level (as EAGLE-2's static trees): a node's children are
        the ranks the tree asks for among the top-k of the head's output at the node. Each
        level's nodes with children then run through the head together (every request's at once,
        one head step per level, as many rows as the level has such nodes), each at position
        ``newest + depth - 1`` (as a chain's draft at that depth) with its parent's output as its
        hidden state, attending to the committed positions, its ancestors' rows and itself (a
        tree mask over the draft rows, which ``live`` keeps after the committed ones). Nothing is
        recomputed along paths: a tree costs depth - 1 head steps, like a chain of its depth,
        only wider."""
        tree = self.tree
        assert tree is not None
        n = len(todo)
        tokens = torch.zeros(n, 1 + tree.num_nodes, dtype=torch.long)  # column 0: the root
        committed = [s.keys[0].shape[0] for s in live]
        out = last[:, None]  # [requests, parents, hidden]: the head at the level's parents
        for lv in self._levels:
            top = self.top_tokens(out.flatten(0, 1), lv.k).view(n, out.shape[1], lv.k)
            tokens[:, lv.nodes] = top[:, lv.parent_slots, lv.ranks]
            if not lv.expand:
                break
            rows = len(lv.expand)
            ids = tokens[:, lv.expand].flatten().tolist()
            hidden = out[:, lv.expand_parent_slots].flatten(0, 1)
            pos = torch.tensor([r.num_tokens - 2 + lv.depth for _, r, _ in todo for _ in range(rows)], device=self.device)  # fmt: skip
            masks = [torch.cat([lv.mask.new_ones(rows, c), lv.mask], 1).to(self.device) for c in committed]  # fmt: skip
            out = self.run(self.embed(ids), hidden, pos, live, [rows] * n, masks).view(n, rows, -1)
        for (i, _, _), row in zip(todo, tokens[:, 1:].tolist(), strict=True):
            drafts[i] = TreeDraft(row, tree)

    def _seq(self, r: DraftRequest) -> _Seq | None:
        """The request's head state, starting over where the target's rows start elsewhere than
        it ended (a cached prefix, a recomputation); None where the rows do not reach the newest
        token (no draft then)."""
        seq = self._seqs.get(r.request_id)
        if seq is None or seq.pos != r.hidden_start:
            seq = self._empty()
            seq.pos = r.hidden_start
            self._seqs[r.request_id] = seq
        return seq if r.hidden_reaches_newest else None

    def finish(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)


class EagleProposer(HeadProposer):
    """vLLM's ``eagle`` method (see the module docstring)."""

    config_keys: ClassVar[frozenset[str]] = frozenset({TREE_KEY})
