"""Building :class:`CommonAttentionMetadata` from per-request facts.

Used by the model runner, the attention conformance suite and model tests, so all of them describe
a step the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmhal.attention.backend import CommonAttentionMetadata


def build_common_metadata(
    query_lens: Sequence[int],
    num_computed: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    tree_mask: torch.Tensor | None = None,
) -> CommonAttentionMetadata:
    """Describe a step: request ``i`` adds ``query_lens[i]`` tokens after ``num_computed[i]`` cached
    ones, and owns the blocks ``block_tables[i]`` (enough for its new length).

    Requests must already be ordered decodes first (query length 1), as the contract requires.
    """
    n = len(query_lens)
    if not (len(num_computed) == len(block_tables) == n):
        raise ValueError(
            "query_lens, num_computed and block_tables must have one entry per request"
        )
    q = torch.tensor(query_lens, dtype=torch.int32)
    ctx = torch.tensor(num_computed, dtype=torch.int32)
    seq = q + ctx
    num_decodes = 0
    while num_decodes < n and query_lens[num_decodes] == 1:
        num_decodes += 1
    if any(ql == 1 for ql in query_lens[num_decodes:]) and tree_mask is None:
        raise ValueError("decode requests (query length 1) must come before prefills")
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q, 0)
    width = max((len(b) for b in block_tables), default=0)
    table = torch.zeros(n, max(width, 1), dtype=torch.int32)
    for i, blocks in enumerate(block_tables):
        need = -(-int(seq[i]) // block_size)
        if len(blocks) < need:
            raise ValueError(
                f"request {i} needs {need} blocks for {int(seq[i])} tokens, has {len(blocks)}"
            )
        table[i, : len(blocks)] = torch.tensor(list(blocks), dtype=torch.int32)
    # Positions and slots of the new tokens, without a Python loop over tokens.
    total = int(qsl[-1])
    req_of_tok = torch.repeat_interleave(torch.arange(n), q.long())
    offset_in_req = torch.arange(total) - qsl[:-1].long()[req_of_tok]
    positions = ctx.long()[req_of_tok] + offset_in_req
    block_ids = table.long()[req_of_tok, positions // block_size]
    slots = block_ids * block_size + positions % block_size
    dev = torch.device(device)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(dev),
        query_start_loc_cpu=qsl,
        seq_lens=seq.to(dev),
        seq_lens_cpu=seq,
        num_computed_tokens_cpu=ctx,
        block_table=table.to(dev),
        slot_mapping=slots.to(dev),
        positions=positions.to(dev),
        num_reqs=n,
        num_actual_tokens=total,
        max_query_len=int(q.max()) if n else 0,
        max_seq_len=int(seq.max()) if n else 0,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        tree_mask=None if tree_mask is None else tree_mask.to(dev),
    )
