"""Pooling a request's prompt hidden states, chunk by chunk, as the engine computes them.

The model runner calls :meth:`PoolingState.add` with the final hidden states of each chunk of a
pooling request's prompt (chunked prefill splits a long prompt over several steps); only what the
pooling type needs is kept (LAST: one row; CLS: the first; MEAN: a running fp32 sum; ALL: every row),
and :meth:`PoolingState.result` gives the pooled tensor once the prompt is done.
"""

from __future__ import annotations

import torch

from llmhal.pooling.params import ResolvedPooling


class PoolingState:
    def __init__(self, pooling: ResolvedPooling, num_prompt_tokens: int) -> None:
        self.pooling = pooling
        self.num_prompt_tokens = num_prompt_tokens
        self._reset()

    def _reset(self) -> None:
        self._rows: list[torch.Tensor] = []
        self._sum: torch.Tensor | None = None
        self._count = 0

    def add(self, hidden: torch.Tensor, start: int) -> None:
        """``hidden``: the final hidden states of prompt positions ``start .. start + len``."""
        if start == 0:  # (re)computed from the first position: after preemption too
            self._reset()
        kind = self.pooling.pooling_type
        end = start + hidden.shape[0]
        if kind == "LAST":
            if end == self.num_prompt_tokens:
                self._rows = [hidden[-1:].float()]
        elif kind == "CLS":
            if start == 0:
                self._rows = [hidden[:1].float()]
        elif kind == "MEAN":
            part = hidden.float().sum(0)
            self._sum = part if self._sum is None else self._sum + part
            self._count += hidden.shape[0]
        else:  # ALL: kept on the host, off the device's memory between steps
            self._rows.append(hidden.float().cpu())

    def result(self) -> torch.Tensor:
        """The pooled vector ([hidden]) or, for ALL, one per prompt token ([tokens, hidden]),
        truncated to ``dimensions`` then L2-normalized as asked; fp32, on the host."""
        kind = self.pooling.pooling_type
        if kind == "MEAN":
            assert self._sum is not None and self._count == self.num_prompt_tokens
            out = self._sum / self._count
        else:
            out = torch.cat(self._rows).cpu()
            if kind != "ALL":
                out = out[0]
        dims = self.pooling.dimensions
        if dims is not None:
            out = out[..., :dims]
        if self.pooling.normalize:
            out = torch.nn.functional.normalize(out, p=2, dim=-1)
        return out.cpu()
