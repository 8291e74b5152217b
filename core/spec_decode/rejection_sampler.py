"""Verification of draft tokens: the one rejection sampler every method goes through.

For each request the target model scored ``k + 1`` positions in one pass: its last committed token
followed by ``k`` drafts. Row ``j`` is the target's distribution for the token after draft ``j - 1``
(row 0: after the committed tokens), processed exactly as non-speculative sampling would process it
at that point (penalties counting the drafts before it as history, temperature, top-k/top-p/min-p).

* Greedy: draft ``j`` is accepted while it equals row ``j``'s argmax; the first argmax that differs
  is emitted instead and ends the run; when every draft is accepted, row ``k``'s argmax (the bonus
  token) follows. The output is the non-speculative output token for token.
* Sampled (the standard rule of Leviathan et al. and Chen et al., 2023): draft ``d`` with draft
  probability ``q(d)`` is accepted with probability ``min(1, p(d) / q(d))``; on the first rejection
  a token is drawn from the residual ``max(p - q, 0)`` (normalised) and ends the run; when every
  draft is accepted, a bonus token is drawn from row ``k``. Each emitted token is then distributed
  as ``p``: the target's distribution is kept whatever the drafts. Without draft probabilities
  (n-gram, suffix, greedy drafters) ``q`` is one-hot on the draft, so ``d`` is accepted with
  probability ``p(d)`` and the residual is ``p`` without ``d``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_greedy(target_argmax: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens emitted for one greedy request: ``target_argmax`` has ``len(drafts) + 1``
    entries (row ``j``'s argmax). At least one token, at most ``len(drafts) + 1``."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        t = int(target_argmax[j])
        out.append(t)
        if t != d:
            return out
    out.append(int(target_argmax[len(drafts)]))
    return out


def accept_sampled(
    target_probs: torch.Tensor,
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens emitted for one sampled request (see the module docstring).

    ``target_probs`` is ``[k + 1, vocab]`` (each row sums to 1), ``draft_probs`` ``[k, vocab]``
    (the distributions the drafts were drawn from) or None (one-hot drafts). Uniforms are drawn in
    float64, so a probability ratio is never compared against an exact 0 by rounding."""
    k = len(drafts)
    if k:
        u = torch.rand(k, dtype=torch.float64, generator=generator).tolist()
    out: list[int] = []
    for j, d in enumerate(drafts):
        p = target_probs[j]
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        p_d = float(p[d])
        if q_d > 0 and p_d / q_d >= u[j] and p_d > 0:
            out.append(int(d))
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[j].to(p.dtype)).clamp_min(0.0)
        if float(residual.sum()) <= 0:  # p equals q: nothing is left to correct; p itself is exact
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generator)[0]))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)[0]))
    return out
