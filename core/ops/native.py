"""Pure-torch definitions of the custom ops: the reference every platform kernel must match.

Layers never call these directly: they resolve each op once with
:func:`llmhal.ops.registry.get_op`, which may return a platform kernel with the same signature.
The numerics follow HF transformers (the parity reference of the project): RMSNorm reduces in
float32 and casts back before the weight multiply; rotary embedding runs in the activation dtype
with cos/sin rounded to it.

Signatures (all tensors on the same device; ``T`` = number of tokens in the flattened step):

``rms_norm(x, weight, eps) -> Tensor``
    ``x`` [..., hidden], ``weight`` [hidden]. ``x / sqrt(mean(x^2) + eps) * weight`` in the dtype of
    ``x``.
``fused_add_rms_norm(x, residual, weight, eps) -> (normed, summed)``
    ``summed = x + residual`` (in the dtype of ``x``) and ``normed = rms_norm(summed, weight, eps)``.
    Inputs are not modified.
``rotary_embedding(positions, query, key, cos_sin_cache, head_size, is_neox) -> (query, key)``
    ``positions`` int64 [T]; ``query`` [T, num_heads * head_size]; ``key`` [T, num_kv_heads *
    head_size]; ``cos_sin_cache`` [max_position, rotary_dim] holding cos in the first half of the
    last dimension and sin in the second (``rotary_dim <= head_size``: only the first ``rotary_dim``
    features of each head rotate). ``is_neox``: rotate the two halves of the rotary features
    (GPT-NeoX/Llama layout); otherwise rotate interleaved pairs (GPT-J layout). Returns tensors of
    the input shapes and dtype; kernels may write the result into ``query``/``key`` in place, so
    callers use the returned tensors and do not reuse the inputs.
``silu_and_mul(x) -> Tensor``
    ``x`` [..., 2 * d] -> ``silu(x[..., :d]) * x[..., d:]`` of shape [..., d].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = normed.to(dtype) * weight
    return out if out.dtype == dtype else out.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, is_neox: bool
) -> torch.Tensor:
    """Rotate ``x`` [T, H * head_size] with ``cos``/``sin`` [T, 1, rotary_dim // 2]."""
    t = x.shape[0]
    xh = x.view(t, -1, head_size)
    rot = cos.shape[-1] * 2
    xr = xh[..., :rot]
    if is_neox:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    rotated = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
    if rot < head_size:
        rotated = torch.cat((rotated, xh[..., rot:]), -1)
    return rotated.reshape(x.shape)


def rotary_cos_sin(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin rows of ``positions`` as [T, 1, rotary_dim // 2] tensors of ``dtype``
    (shared by kernels that read the same cache layout)."""
    cos_sin = cos_sin_cache.index_select(0, positions.flatten())
    if cos_sin.dtype != dtype:
        cos_sin = cos_sin.to(dtype)
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
    return cos, sin


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rotary_cos_sin(positions, cos_sin_cache, query.dtype)
    return _rotate(query, cos, sin, head_size, is_neox), _rotate(key, cos, sin, head_size, is_neox)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
