"""CPU kernels for the custom ops (signatures in :mod:`llmhal.ops.native`).

At decode sizes a small model's step is bound by per-op overhead, not arithmetic, so float32 calls
go to native kernels (``kernels/fused_ops.cpp``): one pass and one call per op instead of 15-30 us
through torch for SmolLM2's [32, 576] rows (~2.7 -> ~1.3 ms of a batch-32 decode step). Other
dtypes and layouts, and hosts without a compiler, use torch kernels that compute the same values as
the native definitions with as few torch calls as possible:

* ``rms_norm``: torch's fused ``rms_norm`` kernel (float32; bit-identical to the native reduction on
  this CPU), and for 16-bit inputs the fused kernel in float32 followed by HF's cast-then-weight.
* ``rotary_embedding``: rotates in place, and when ``key`` directly follows ``query`` in each row
  (the q/k/v split of a fused projection) it rotates both through one strided view: 6 arithmetic
  calls for q and k together instead of about 20.
* ``silu_and_mul``: multiplies into the activation's fresh output instead of a third tensor.

The native kernels differ from torch's only in rounding (the order of a row's sum, a 1-ulp exp):
within 1e-6 relative, except SiLU below -87 where exp saturates (~1e-37 instead of -0.0; -inf gives
-inf, not NaN); rotary is bit-identical. ``LLMHAL_CPU_OPS_KERNEL=0`` keeps torch's.

``LLMHAL_CPU_COMPILE=1`` uses ``torch.compile`` of the native definitions instead (dynamic shapes,
the platform's inductor backend). Measured on 2 cores (SmolLM2-135M shapes) it does not pay: about 6 s of compile
per op and process, and slower calls at decode (guard overhead exceeds the saved dispatch), so it
stays off by default; it is kept for hosts where a C++ loop beats torch's kernels.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from llmhal.ops.native import rotary_cos_sin
from llmhal_cpu.kernels import fused_ops


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    done = fused_ops.rms_norm(x, weight, eps)
    if done is not None:
        return done[0]
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    out = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    done = fused_ops.rms_norm(x, weight, eps, residual)
    if done is not None:
        return done  # type: ignore[return-value]  # (normed, summed): residual was given
    summed = x + residual
    return _rms_norm(summed, weight, eps), summed


def _joint_qk_view(query: torch.Tensor, key: torch.Tensor, head_size: int) -> torch.Tensor | None:
    """A [T, Hq + Hk, head_size] view covering query and key when key follows query in memory."""
    if query.dim() != 2 or query.dtype != key.dtype:
        return None
    stride = query.stride()
    if stride[1] != 1 or key.stride() != stride:
        return None
    if key.storage_offset() != query.storage_offset() + query.shape[1]:
        return None
    if query.untyped_storage().data_ptr() != key.untyped_storage().data_ptr():
        return None
    heads = (query.shape[1] + key.shape[1]) // head_size
    return query.as_strided((query.shape[0], heads, head_size), (stride[0], head_size, 1))


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> None:
    """Rotate ``x`` [T, H, rotary_dim] in place; ``cos``/``sin`` [T, 1, rotary_dim // 2]."""
    half = cos.shape[-1]
    x1, x2 = (x[..., :half], x[..., half:]) if is_neox else (x[..., 0::2], x[..., 1::2])
    x2_sin = x2 * sin
    x1_sin = x1 * sin
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)


def _rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if fused_ops.rotary_(positions, query, key, cos_sin_cache, head_size, is_neox):
        return query, key
    cos, sin = rotary_cos_sin(positions, cos_sin_cache, query.dtype)
    rot = 2 * cos.shape[-1]
    joint = _joint_qk_view(query, key, head_size)
    if joint is not None:
        _rotate_(joint if rot == head_size else joint[..., :rot], cos, sin, is_neox)
        return query, key
    t = query.shape[0]
    query = query.contiguous()
    key = key.contiguous()
    for x in (query.view(t, -1, head_size), key.view(t, -1, head_size)):
        _rotate_(x if rot == head_size else x[..., :rot], cos, sin, is_neox)
    return query, key


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    done = fused_ops.silu_and_mul(x)
    if done is not None:
        return done
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]).mul_(x[..., d:])


def _select(name: str, eager: Callable[..., Any]) -> Callable[..., Any]:
    """The eager kernel, or with ``LLMHAL_CPU_COMPILE=1`` the compiled native definition (the eager
    kernels inspect pointers and write in place, which does not trace)."""
    if os.environ.get("LLMHAL_CPU_COMPILE", "0").strip().lower() not in ("1", "true"):
        eager.status = fused_ops.status  # type: ignore[attr-defined]  # shown by llmhal doctor
        return eager
    from llmhal.ops import native
    from llmhal_cpu.platform import CpuPlatform

    return torch.compile(
        getattr(native, name), backend=CpuPlatform.simple_compile_backend, dynamic=True
    )


rms_norm = _select("rms_norm", _rms_norm)
fused_add_rms_norm = _select("fused_add_rms_norm", _fused_add_rms_norm)
rotary_embedding = _select("rotary_embedding", _rotary_embedding)
silu_and_mul = _select("silu_and_mul", _silu_and_mul)
