"""Rotary position embeddings (RoPE) and their scaling variants, applied by the ``rotary_embedding`` op.

:func:`get_rope` builds (and shares between layers) a :class:`RotaryEmbedding` that holds a
``cos_sin_cache`` [max_position, rotary_dim] in the model dtype: cos and sin are computed in float32
from the inverse frequencies and rounded once, exactly as HF transformers rounds them per step.

Scaling types (``rope_type`` in the HF config; frequencies as HF defines them):

* ``default``: ``inv_freq[i] = base ** (-2i / rotary_dim)``;
* ``linear``: ``inv_freq / factor`` (position interpolation);
* ``dynamic`` (NTK-aware): HF rescales the base from the current sequence length whenever it exceeds
  ``max_position_embeddings``. A paged KV cache keeps keys rotated once, so llmhal uses one static
  table: unscaled while the engine's ``max_position`` fits the original context (identical to HF for
  every sequence it can serve), otherwise the base HF would use for a sequence of ``max_position``;
* ``llama3``: Llama 3.1's frequency-dependent smoothing (``factor``, ``low_freq_factor``,
  ``high_freq_factor``, ``original_max_position_embeddings``);
* ``yarn``: YaRN interpolation with its attention factor applied to cos and sin.

:func:`rope_parameters` reads both transformers-4 configs (``rope_theta`` + ``rope_scaling``) and
transformers-5 configs (``rope_parameters``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from llmhal.layers.layernorm import default_params_dtype
from llmhal.ops.registry import get_op

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_ALIASES = {"su": "longrope", "mrope": "default"}


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The RoPE parameters of an HF config as one flat dict with ``rope_type`` and ``rope_theta``.

    transformers-5 ``rope_parameters`` wins over transformers-4 ``rope_scaling`` and
    ``rope_theta`` attributes; a missing theta is 10000 (HF's default).
    """
    legacy = getattr(hf_config, "rope_scaling", None)
    params = getattr(hf_config, "rope_parameters", None)
    out: dict[str, Any] = {}
    for part in (legacy, params):
        if isinstance(part, Mapping):
            if part and all(isinstance(v, Mapping) for v in part.values()):
                raise ValueError(
                    f"per-layer-type RoPE parameters ({', '.join(part)}) are not supported by "
                    "llmhal's built-in models"
                )
            out.update(part)
    rope_type = out.get("rope_type") or out.get("type") or "default"
    out["rope_type"] = _ALIASES.get(rope_type, rope_type)
    if out.get("rope_theta") is None:
        out["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    if out.get("partial_rotary_factor") is None:
        out["partial_rotary_factor"] = getattr(hf_config, "partial_rotary_factor", None) or 1.0
    return out


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(base: float, dim: int, p: Mapping[str, Any]) -> torch.Tensor:
    inv_freq = _base_inv_freq(base, dim)
    factor = p["factor"]
    low, high = p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(
    base: float, dim: int, p: Mapping[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = corr_dim(fast), corr_dim(slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrap = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv_freq, attn


def compute_inv_freq(
    params: Mapping[str, Any], rotary_dim: int, max_position: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32 [rotary_dim // 2]) and the cos/sin scale for ``params``.

    ``max_position`` is the longest sequence the engine serves; ``max_position_embeddings`` the
    model's configured context (HF's reference length for ``dynamic`` and ``yarn``).
    """
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    if rope_type == "default":
        return _base_inv_freq(base, rotary_dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, rotary_dim) / params["factor"], 1.0
    if rope_type == "dynamic":
        if max_position > max_position_embeddings:
            factor = params["factor"]
            ratio = factor * max_position / max_position_embeddings - (factor - 1)
            base = base * ratio ** (rotary_dim / (rotary_dim - 2))
        return _base_inv_freq(base, rotary_dim), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(base, rotary_dim, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, rotary_dim, params, max_position_embeddings)
    raise ValueError(
        f"RoPE scaling type {rope_type!r} is not supported; supported: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the flattened query and key of a step: ``forward(positions, q, k)``."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        inv_freq: torch.Tensor,
        *,
        is_neox_style: bool = True,
        attention_scaling: float = 1.0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if rotary_dim > head_size or rotary_dim % 2:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_size {head_size}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.is_neox_style = is_neox_style
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
        cache = torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), -1)
        self.register_buffer("cos_sin_cache", cache.to(dtype), persistent=False)
        self._op = get_op("rotary_embedding")

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._op(
            positions, query, key, self.cos_sin_cache, self.head_size, self.is_neox_style
        )

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"max_position={self.max_position}, neox={self.is_neox_style}"
        )


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    params: Mapping[str, Any] | None = None,
    *,
    max_position_embeddings: int | None = None,
    is_neox_style: bool = True,
    dtype: torch.dtype | None = None,
) -> RotaryEmbedding:
    """A :class:`RotaryEmbedding`; ``params`` as returned by :func:`rope_parameters`.

    Models build one and share it between their layers, so a 30-layer model holds one table.
    """
    params = dict(params or {"rope_type": "default", "rope_theta": 10000.0})
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", 10000.0)
    max_pe = max_position_embeddings or max_position
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", max_pe)
    inv_freq, scaling = compute_inv_freq(params, rotary_dim, max_position, max_pe)
    return RotaryEmbedding(
        head_size,
        rotary_dim,
        max_position,
        inv_freq,
        is_neox_style=is_neox_style,
        attention_scaling=scaling,
        dtype=dtype or default_params_dtype(),
    )


def get_rope_from_hf_config(
    hf_config: Any,
    head_size: int,
    *,
    max_position: int | None = None,
    is_neox_style: bool = True,
    dtype: torch.dtype | None = None,
) -> RotaryEmbedding:
    """The RoPE of an HF decoder config (``max_position`` defaults to its context length)."""
    params = rope_parameters(hf_config)
    max_pe = int(hf_config.max_position_embeddings)
    rotary_dim = int(head_size * params["partial_rotary_factor"])
    return get_rope(
        head_size,
        rotary_dim,
        max_position or max_pe,
        params,
        max_position_embeddings=max_pe,
        is_neox_style=is_neox_style,
        dtype=dtype,
    )
