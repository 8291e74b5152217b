"""The mixture-of-experts op (``fused_moe``): routing, the experts' gated MLPs and their weighted sum.

Signature (dispatched through :func:`llmhal.ops.registry.get_op`; a platform kernel takes the same)::

    fused_moe(hidden, w13, w2, router_logits, top_k, *, renormalize=True, scoring_func="softmax",
              num_expert_group=None, topk_group=None, e_score_correction_bias=None,
              routed_scaling_factor=1.0, activation="silu", w13_scale=None, w2_scale=None,
              shared_output=None, shared_gate=None) -> Tensor

``hidden`` [T, H]; ``w13`` [E, 2I, H] holds each expert's gate rows then its up rows; ``w2``
[E, H, I] its down projection; ``router_logits`` [T, E]. Each token goes to ``top_k`` experts and
the result is ``sum_k weight_k * w2[e_k] @ act(w13[e_k, :I] @ x) * (w13[e_k, I:] @ x)`` in the
dtype of ``hidden``. With ``w13_scale`` [E, 2I] / ``w2_scale`` [E, H] the weights are int8 with one
scale per output row (``w = q * scale``, the ``experts_int8`` layout). ``w13``/``w2`` may also be
:class:`~llmhal.ops.expert_kernels.ExpertKernels` (quantized experts as per-expert kernels; the
op's ``accepts_expert_kernels`` attribute says whether an implementation takes them).

``shared_output`` [T, H] (the shared experts' output, in ``hidden``'s dtype) is added to the result,
scaled by ``sigmoid(shared_gate)`` [T, 1] when that is given (Qwen2-MoE's gated shared expert):
what :func:`add_shared` computes. A kernel that takes them declares ``accepts_shared_output =
True``; :class:`~llmhal.layers.fused_moe.FusedMoE` adds them itself for one that does not. Inside
the op the sum can be one native call with the experts (a CPU decode step records only native
calls) and rounded once.

Routing (:func:`select_experts`) follows the published models: ``softmax`` (Mixtral, Qwen-MoE) or
``sigmoid`` (DeepSeek-V3) scores in float32; with ``num_expert_group`` the experts are split in
groups and only the ``topk_group`` best groups compete (a group scores its best expert, or the sum
of its best two when ``e_score_correction_bias`` is given, as DeepSeek-V3 does); the bias shifts
which experts are chosen but not their weights; ``renormalize`` makes the chosen weights sum to one,
then they are multiplied by ``routed_scaling_factor``.

The reference computes only the experts that some token chose: tokens are sorted by expert and
each active expert runs two matmuls over its own rows, so an inactive expert costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

SCORING_FUNCS = ("softmax", "sigmoid")


def gated_activation(activation: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if activation == "silu":
        act = F.silu
    elif activation in ("gelu", "gelu_pytorch_tanh"):
        approx = "tanh" if activation == "gelu_pytorch_tanh" else "none"
        act = lambda x: F.gelu(x, approximate=approx)  # noqa: E731
    else:
        raise ValueError(
            f"fused_moe activation {activation!r} is not supported (silu, gelu, gelu_pytorch_tanh)"
        )

    def fn(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return act(x[..., :d]) * x[..., d:]

    return fn


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    scoring_func: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, top_k], expert ids int64 [T, top_k]) for each token."""
    logits = router_logits.float()
    if scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(
            f"fused_moe scoring_func {scoring_func!r} is not supported ({', '.join(SCORING_FUNCS)})"
        )
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group and num_expert_group > 1:
        t, e = choice.shape
        if e % num_expert_group or not topk_group:
            raise ValueError(
                f"grouped top-k needs the {e} experts split evenly in num_expert_group="
                f"{num_expert_group} groups and topk_group set (got {topk_group})"
            )
        grouped = choice.view(t, num_expert_group, e // num_expert_group)
        if e_score_correction_bias is None:
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1)[1], True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // num_expert_group, dim=1), -1e30)
    if e_score_correction_bias is None and not (num_expert_group and num_expert_group > 1):
        weights, ids = scores.topk(top_k, dim=-1)
    else:
        ids = choice.topk(top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids


def add_shared(
    out: torch.Tensor, shared_output: torch.Tensor | None, shared_gate: torch.Tensor | None
) -> torch.Tensor:
    """``out + shared_output`` (times ``sigmoid(shared_gate)`` when given): the shared experts'
    part of a MoE block, as the published models add it."""
    if shared_output is None:
        return out
    if shared_gate is not None:
        shared_output = shared_output * torch.sigmoid(shared_gate)
    return out + shared_output


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in the router weight's dtype, ``x`` widened to it: a router kept wider
    than the model (DeepSeek's float32 ``gate`` in a bf16 model) scores the tokens in its own
    precision. The ``router_logits`` op: a platform's kernel computes the same without a separate
    cast (a cast is a torch op, which a recorded CPU decode step cannot contain)."""
    return F.linear(x.to(weight.dtype), weight)


def project(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T`` for one expert's rows; with ``scale``, ``w`` is int8 with one scale per row."""
    if not isinstance(w, torch.Tensor):  # one expert of ExpertKernels: the kernel runs itself
        return w(x)
    if scale is None:
        return F.linear(x, w)
    # int8 rows: (x @ q.T) * s equals x @ (q * s).T up to rounding; the conversion is exact.
    return (F.linear(x, w.to(x.dtype)) * scale).to(x.dtype)


def grouped_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = project,
) -> torch.Tensor:
    """The experts' weighted sum for routed tokens (``weights``/``ids`` from :func:`select_experts`).

    Rows of (token, choice) are sorted by expert so each active expert sees one contiguous block;
    experts no token chose are never touched. Kernels that only replace the activation or the
    matmul of one expert (:func:`project`'s signature) reuse this with their own.
    """
    t, k = ids.shape
    flat = ids.reshape(-1)
    if t * k == 1:
        order = torch.zeros(1, dtype=torch.long, device=hidden.device)
        counts = [0] * w13.shape[0]
        counts[int(flat[0])] = 1
    else:
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    token_of = order // k
    xs = hidden.index_select(0, token_of) if t * k > 1 else hidden
    out = torch.empty(t * k, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = xs[start : start + n]
        s13 = None if w13_scale is None else w13_scale[e]
        s2 = None if w2_scale is None else w2_scale[e]
        y = matmul(act_and_mul(matmul(rows, w13[e], s13)), w2[e], s2)
        out[start : start + n] = y
        start += n
    out.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(-1))
    if k == 1:
        summed = torch.empty_like(out).index_copy_(0, token_of, out)
    else:
        summed = torch.zeros(t, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        summed.index_add_(0, token_of, out)
    return summed.to(hidden.dtype)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    scoring_func: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    activation: str = "silu",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    shared_output: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    weights, ids = select_experts(
        router_logits,
        top_k,
        renormalize=renormalize,
        scoring_func=scoring_func,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor,
    )
    out = grouped_experts(
        hidden,
        w13,
        w2,
        weights,
        ids,
        act_and_mul=gated_activation(activation),
        w13_scale=w13_scale,
        w2_scale=w2_scale,
    )
    return add_shared(out, shared_output, shared_gate)


fused_moe.accepts_expert_kernels = True  # type: ignore[attr-defined]
fused_moe.accepts_shared_output = True  # type: ignore[attr-defined]
