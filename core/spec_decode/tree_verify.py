"""Draft trees: their shape, their verification, and moving the accepted path's KV into place.

A proposer that guesses several continuations at once (Medusa's top-k per head) returns a
:class:`TreeDraft`: draft tokens as the nodes of a tree whose root (node 0) is the request's last
committed token. The target scores every node in ONE forward: node ``i`` sits at position
``committed + depth(i)`` and attends to the cached prefix and to its ancestors only (the tree mask,
through the ``tree_attn`` backend); its KV goes to slot ``committed + i`` (node order), so the KV of
the nodes on the accepted path must afterwards be copied down to ``committed + depth``
(:func:`compact_path_kv`). KV written for other nodes lies past the request's computed tokens and
is never read: the next step overwrites it.

Node order: the top-1 chain first (nodes ``1..chain_len``, each the child of the one before), then
the other nodes by depth; every parent comes before its children. Because the chain leads, a tree
the scheduler trimmed (too few tokens of budget or KV blocks) is still verified exactly as the
chain it starts with: under the causal rule each chain node sees exactly its ancestors.

Acceptance walks the tree from the root. Greedy: follow the child whose token is the target's
argmax; the first argmax with no such child is emitted and ends the run (a leaf reached adds the
target's bonus token). Sampled: at each node the children are tried in order, each accepted with
the target's probability of its token renormalised over what the earlier (rejected) siblings left;
when none is accepted, a token is drawn from that remainder. Each emitted token is then distributed
as the target's ``p`` (the multi-candidate form of the rejection rule, drafts being one-hot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch


@dataclass(frozen=True)
class DraftTree:
    """A tree's shape: ``parents[i - 1]`` is the parent of node ``i`` (``0`` the root), each
    smaller than ``i``."""

    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        for i, p in enumerate(self.parents, start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i}'s parent {p} must come before it (0..{i - 1})")

    @property
    def num_nodes(self) -> int:
        """Draft nodes (the root not counted)."""
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of every node, the root (0) included."""
        d = [0]
        for p in self.parents:
            d.append(d[p] + 1)
        return tuple(d)

    @property
    def depth(self) -> int:
        return max(self.depths)

    @cached_property
    def chain_len(self) -> int:
        """Leading nodes that form a chain from the root (see the module docstring)."""
        n = 0
        while n < len(self.parents) and self.parents[n] == n:
            n += 1
        return n

    @property
    def is_chain(self) -> bool:
        return self.chain_len == self.num_nodes

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for i, p in enumerate(self.parents, start=1):
            kids[p].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def mask(self) -> torch.Tensor:
        """bool [1 + n, 1 + n]: node ``i`` sees node ``j`` iff ``j`` is ``i`` or an ancestor."""
        n = self.num_nodes + 1
        m = torch.zeros(n, n, dtype=torch.bool)
        m[0, 0] = True
        for i, p in enumerate(self.parents, start=1):
            m[i] = m[p]
            m[i, i] = True
        return m

    def path(self, node: int) -> list[int]:
        """The nodes from the root's first child down to ``node``."""
        out = []
        while node:
            out.append(node)
            node = self.parents[node - 1]
        return out[::-1]

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> tuple[DraftTree, list[tuple[int, ...]]]:
        """A tree from Medusa's ``medusa_choices`` (each a path of top-k ranks, one per depth;
        every prefix of a path is a node too): the tree, and each node's path (its ranks)."""
        nodes = {tuple(p[:d]) for p in paths for d in range(1, len(p) + 1)}
        if not nodes:
            raise ValueError("a draft tree needs at least one path")
        if any(r < 0 for n in nodes for r in n):
            raise ValueError("tree paths hold top-k ranks (>= 0)")
        chain = sorted((n for n in nodes if not any(n)), key=len)
        rest = sorted(nodes - set(chain), key=lambda n: (len(n), n))
        order = [(), *chain, *rest]
        index = {n: i for i, n in enumerate(order)}
        parents = tuple(index[n[:-1]] for n in order[1:])
        return cls(parents), order[1:]


@dataclass(frozen=True)
class TreeDraft:
    """What a tree proposer returns for one request: one token per node, in node order."""

    tokens: list[int]
    tree: DraftTree


_TREE_EXAMPLE = '"[(0,), (1,), (0, 0), (1, 0)]"'


def parse_token_tree(value: Any, key: str, prefix_closed: bool = True) -> list[tuple[int, ...]]:
    """A tree given as rank paths in the speculative config (vLLM's ``speculative_token_tree``: a
    string holding a Python list of tuples, or the list itself; JSON lists of lists too), checked:
    non-empty paths of ranks >= 0, none twice, every path's parent path given (prefix-closed, as
    vLLM requires; ``prefix_closed=False`` for Medusa's ``medusa_choices``, whose paths stand for
    their prefixes too), at most ``MAX_SPEC_LEN`` nodes. ValueError naming ``key`` and the
    remedy."""
    import ast

    from llmhal.spec_decode.config import MAX_SPEC_LEN

    def refuse(problem: str) -> ValueError:
        return ValueError(
            f"speculative_config[{key!r}] {problem}; give a list of paths of top-k ranks, one rank "
            f"per depth, each path's parent path listed too, e.g. {_TREE_EXAMPLE}"
        )

    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            # TypeError: a literal that cannot be built, such as a set of lists ('{[0]}').
            raise refuse(f"({value!r}) is not a Python or JSON literal") from None
    if not isinstance(value, list | tuple) or not value:
        raise refuse(f"is {value!r}, not a non-empty list")
    paths = []
    for p in value:
        ok = isinstance(p, list | tuple) and p and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p)  # fmt: skip
        if not ok:
            raise refuse(f"holds {p!r}, which is not a non-empty path of ranks >= 0")
        paths.append(tuple(p))
    seen = set(paths)
    if len(seen) != len(paths):
        raise refuse("lists a path twice")
    if prefix_closed:
        orphan = next((p for p in paths if len(p) > 1 and p[:-1] not in seen), None)
        if orphan is not None:
            raise refuse(f"lists {orphan} but not its parent {orphan[:-1]}")
    nodes = len({p[:d] for p in paths for d in range(1, len(p) + 1)})
    if nodes > MAX_SPEC_LEN:
        raise refuse(f"has {nodes} nodes, more than {MAX_SPEC_LEN}")
    return paths


def check_tree_depth(paths: list[tuple[int, ...]], num_speculative_tokens: int, key: str) -> None:
    """Refuse a tree deeper than ``num_speculative_tokens``; ValueError naming ``key``."""
    depth = max(map(len, paths))
    if depth > num_speculative_tokens:
        raise ValueError(
            f"speculative_config[{key!r}] is {depth} deep, more than "
            f"num_speculative_tokens={num_speculative_tokens}; raise num_speculative_tokens to "
            f"{depth} (or leave it out where a tree's depth is its default) or give shorter paths"
        )


def check_tree_ranks(paths: list[tuple[int, ...]], vocab: int, key: str, where: str) -> None:
    """Refuse a tree whose ranks reach past the ``vocab`` tokens the drafter chooses from (its
    top-k would fail at the first proposal, mid-serving); ValueError naming ``key``."""
    top = max(max(p) for p in paths)
    if top >= vocab:
        raise ValueError(
            f"speculative_config[{key!r}] asks for rank {top}, but {where} chooses from "
            f"{vocab} tokens; keep every rank below {vocab}"
        )


def default_tree(depth: int, width: int = 2) -> list[tuple[int, ...]]:
    """A small default shape as rank paths: the top-1 chain ``depth`` long, and at every depth the
    next ``width - 1`` ranks branching off it (a leaf each)."""
    paths = [(0,) * d for d in range(1, depth + 1)]
    paths += [(0,) * (d - 1) + (r,) for d in range(1, depth + 1) for r in range(1, width)]
    return paths


def accept_greedy_tree(argmax: Sequence[int], tokens: Sequence[int], tree: DraftTree) -> tuple[list[int], list[int]]:  # fmt: skip
    """The tokens emitted and the nodes on the accepted path (root first)."""
    node, out, rows = 0, [], [0]
    while True:
        t = int(argmax[node])
        out.append(t)
        child = next((c for c in tree.children[node] if tokens[c - 1] == t), None)
        if child is None:
            return out, rows
        node = child
        rows.append(child)


def accept_sampled_tree(
    probs: torch.Tensor,
    tokens: Sequence[int],
    tree: DraftTree,
    generator: torch.Generator | None = None,
) -> tuple[list[int], list[int]]:
    """Sampled acceptance over the tree (see the module docstring); ``probs`` [1 + n, vocab]."""
    node, out, rows = 0, [], [0]
    while True:
        p = probs[node].double().clone()
        for child in tree.children[node]:
            t = tokens[child - 1]
            total = float(p.sum())
            if total <= 0:
                break
            u = float(torch.rand(1, dtype=torch.float64, generator=generator))
            if p[t] > 0 and u < float(p[t]) / total:
                out.append(int(t))
                rows.append(child)
                node = child
                break
            p[t] = 0.0
        else:
            if float(p.sum()) <= 0:  # the children held all the mass (only after rounding)
                p = probs[node].double()
            out.append(int(torch.multinomial(p, 1, generator=generator)[0]))
            return out, rows


def compact_path_kv(layers: Sequence[Any], block_ids: Sequence[int], block_size: int, computed: int, rows: Sequence[int]) -> None:  # fmt: skip
    """Copy the KV of the accepted path's nodes (``rows``, root first) from the slots the tree step
    wrote them to (``computed + node``) down to ``computed + depth``, in every attention layer
    (caches in the shared layout ``[2, blocks, block_size, ...]``)."""
    moves = [(computed + r, computed + d) for d, r in enumerate(rows) if r != d]
    if not moves:
        return
    table = torch.tensor(list(block_ids), dtype=torch.long)
    src = torch.tensor([m[0] for m in moves])
    dst = torch.tensor([m[1] for m in moves])
    src = table[src // block_size] * block_size + src % block_size
    dst = table[dst // block_size] * block_size + dst % block_size
    for layer in layers:
        kv = layer.kv_cache
        flat = kv.view(kv.shape[0], kv.shape[1] * kv.shape[2], *kv.shape[3:])
        flat[:, dst.to(kv.device)] = flat[:, src.to(kv.device)]  # the right side is a copy
