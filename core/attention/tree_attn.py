"""``tree_attn``: attention for verifying speculative draft trees (kind ``tree``).

In a verification step every request scores a draft tree of ``q`` tokens at once
(``CommonAttentionMetadata.tree_mask``, bool [q, q], topologically ordered): draft token ``i`` sees
the whole cached prefix plus the draft tokens ``j`` with ``tree_mask[i, j]`` (its ancestors and
itself). Requests with another query length in the same step (decodes, prefill chunks) get the
ordinary causal rule, so a verification step may be mixed with normal work.

Vectorised: requests are processed in groups padded to the group's longest query and key length;
each group is one gather of its keys/values from the paged cache (shared layout and fp8 rule of
:mod:`llmhal.attention.paged_kv`), one mask tensor and two einsums in float32. There is no Python
loop over tokens; the loop over groups only bounds memory (:data:`SCORE_BUDGET`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmhal.attention import paged_kv
from llmhal.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerState,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from llmhal.attention.utils import check_causal

SCORE_BUDGET = 32 << 20  # score elements per group per query head (x4 bytes)


@dataclass(frozen=True)
class TreeGroup:
    """Consecutive requests attended together, padded to ``[num_reqs, max_q]`` x ``max_k``."""

    token_index: torch.Tensor  # int64 [n, max_q]: row of each query in the step (clamped)
    token_valid: torch.Tensor  # bool [n, max_q]
    slots: torch.Tensor  # int64 [n, max_k]: cache slot of each key position (clamped)
    mask: torch.Tensor  # bool [n, max_q, max_k]


@dataclass(frozen=True)
class TreeMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    groups: tuple[TreeGroup, ...]


def _groups(seq_lens: list[int], query_lens: list[int], num_heads: int) -> list[tuple[int, int]]:
    """Split requests into consecutive groups whose padded scores fit SCORE_BUDGET."""
    out, start, mq, mk = [], 0, 0, 0
    for r, (k, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        nq, nk = max(mq, q), max(mk, k)
        if r > start and (r - start + 1) * nq * nk * num_heads > SCORE_BUDGET:
            out.append((start, r))
            start, nq, nk = r, q, k
        mq, mk = nq, nk
    out.append((start, len(seq_lens)))
    return out


class TreeMetadataBuilder(AttentionMetadataBuilder[TreeMetadata]):
    def build(self, common: CommonAttentionMetadata) -> TreeMetadata:
        check_causal(common, TreeAttentionBackend.name)
        bs = self.requirements.block_size
        dev = common.block_table.device
        tree = common.tree_mask
        q_lens = [int(x) for x in common.query_lens_cpu()]
        k_lens = [int(x) for x in common.seq_lens_cpu]
        starts = common.query_start_loc_cpu
        groups = []
        for r0, r1 in _groups(k_lens, q_lens, self.requirements.num_heads):
            if r0 == r1:
                continue
            max_q, max_k = max(q_lens[r0:r1]), max(k_lens[r0:r1])
            qi = torch.arange(max_q, device=dev)
            kpos = torch.arange(max_k, device=dev)
            q_len = torch.tensor(q_lens[r0:r1], device=dev)
            k_len = torch.tensor(k_lens[r0:r1], device=dev)
            ctx = k_len - q_len
            token = starts[r0:r1].to(dev).long()[:, None] + qi
            valid = qi[None, :] < q_len[:, None]
            token = torch.where(valid, token, 0)
            qpos = common.positions[token]  # [n, max_q]
            table = common.block_table[r0:r1].long()
            width = table.shape[1]
            blk = (kpos // bs).clamp(max=width - 1)
            slots = table[:, blk] * bs + kpos % bs  # [n, max_k]
            live = kpos[None, :] < k_len[:, None]
            mask = kpos[None, None, :] <= qpos[:, :, None]
            if tree is not None:
                t = tree.shape[0]
                rel = kpos[None, :] - ctx[:, None]  # [n, max_k]: index among the new tokens
                seen = tree.bool()[qi.clamp(max=t - 1)][:, rel.clamp(0, t - 1)]  # [max_q, n, max_k]
                tree_rule = (rel < 0)[:, None, :] | seen.transpose(0, 1)
                is_tree = q_len == t
                if common.tree_requests is not None:
                    is_tree &= common.tree_requests[r0:r1].to(dev)
                mask = torch.where(is_tree[:, None, None], tree_rule, mask)
            mask &= live[:, None, :] & valid[:, :, None]
            groups.append(TreeGroup(token, valid, torch.where(live, slots, 0), mask))
        return TreeMetadata(
            num_actual_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            groups=tuple(groups),
        )


class TreeAttentionImpl(AttentionImpl[TreeMetadata]):
    def forward(
        self,
        layer: AttentionLayerState,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TreeMetadata,
    ) -> torch.Tensor:
        m = attn_metadata
        out = paged_kv.store_and_allocate(layer, query, key, value, kv_cache, m.slot_mapping)
        group = self.num_heads // self.num_kv_heads
        for g in m.groups:
            n, max_q = g.token_index.shape
            k, v = paged_kv.read_kv(
                kv_cache, g.slots, layer.k_scale, layer.v_scale
            )  # [n, K, Hkv, D]
            q = query[g.token_index].float().view(n, max_q, self.num_kv_heads, group, -1)
            scores = torch.einsum("nqhgd,nkhd->nhgqk", q, k) * self.scale
            if self.logits_soft_cap:
                cap = self.logits_soft_cap
                scores = cap * torch.tanh(scores / cap)
            scores = scores.masked_fill(~g.mask[:, None, None], float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(nan=0.0)  # a padded row sees nothing
            res = torch.einsum("nhgqk,nkhd->nqhgd", probs, v).reshape(n, max_q, self.num_heads, -1)
            out[g.token_index[g.token_valid]] = res[g.token_valid].to(query.dtype)
        return out


class TreeAttentionBackend(paged_kv.SharedKVLayout, AttentionBackend):
    """Draft-tree verification over the paged KV cache (see the module docstring)."""

    name = "tree_attn"
    kind = "tree"
    supported_dtypes = ("float32", "bfloat16", "float16")
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2", "int8", "nvfp4")
    supports_sliding_window = False  # not defined together with a tree mask
    supports_logits_soft_cap = True

    @staticmethod
    def get_impl_cls() -> type[TreeAttentionImpl]:
        return TreeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TreeMetadataBuilder]:
        return TreeMetadataBuilder
