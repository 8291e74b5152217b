"""KV-cache storage formats: what ``kv_cache_dtype`` means for one stored key or value row.

A *row* is one token's key (or value) for one KV head: ``head_size`` values. Every format keeps the
paged layouts of :mod:`llmhal.attention.paged_kv` (and the MLA latent layout) and changes only what
a row holds and its length, the last dimension of the cache tensor:

=============  ==================  ==========================================================  ===========
name           element type        a row of ``D`` values                                       bytes a row
=============  ==================  ==========================================================  ===========
``auto``       the model dtype     the values                                                  ``D * itemsize``
``fp8_e4m3``   ``float8_e4m3fn``   ``fp8(x / scale)``, saturated (see ``paged_kv``)             ``D``
``fp8_e5m2``   ``float8_e5m2``     as above                                                    ``D``
``int8``       ``int8``            ``D`` int8 values, then the row's float32 scale (4 bytes)    ``D + 4``
``nvfp4``      ``uint8``           ``D / 2`` bytes of packed e2m1 codes, then ``D / 16`` e4m3   ``D / 2 + D / 16``
                                   block scales
=============  ==================  ==========================================================  ===========

``int8`` is vLLM's INT8 KV cache (``int8_per_token_head``): each token's each head gets its own
scale ``max|x| / 127``, computed when the row is written; no checkpoint scale is involved. The scale
lives at the end of its row so a slot still addresses one contiguous piece of memory and the
block tables, prefix caching and the MLA latent cache work unchanged.

``nvfp4`` is NVIDIA's FP4 format: 16 consecutive values share an e4m3 block scale and each value is a
4-bit e2m1 code (sign and one of 0, 0.5, 1, 1.5, 2, 3, 4, 6), two codes a byte, the even element in
the low nibble. NVFP4's per-tensor fp32 scale is the layer's ``k_scale``/``v_scale`` divided by 6:
with it the block scale is the block's ``max|x| / scale`` stored in e4m3, so nvfp4 covers exactly
the range fp8 e4m3 covers under the same layer scale (``|x| <= 448 * scale``). ``head_size`` must
be a multiple of 16. No CPU has FP4 arithmetic: rows are decoded to the compute dtype before
attention (on hardware that has it a backend may read the codes directly).

The element type of a cache tensor names its format (int8: ``int8``, uint8: ``nvfp4``), as it does
for fp8, so the shared read/write helpers need only the tensor. Sizes per token (the formula the
engine's load report and ``llmhal doctor`` use) are :func:`kv_bytes_per_token`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Other spellings accepted for a format: vLLM's names.
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "int8_per_token_head": "int8"}

_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_E4M3_MAX = 448.0
_E2M1_MAX = 6.0
# The 16 e2m1 codes: bit 3 is the sign, bits 0-2 index the magnitudes.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TABLE = torch.tensor(_E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), dtype=torch.float32)
# Row b: the values of byte b's low and high nibble (the even element is the low one).
_E2M1_PAIRS = torch.stack([_E2M1_TABLE.repeat(16), _E2M1_TABLE.repeat_interleave(16)], dim=1)
# Midpoints between neighbouring magnitudes, and whether a value exactly on one rounds up: ties go
# to the even code (round-to-nearest-even, as hardware FP4 conversion does).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                   (3.5, True), (5.0, False))  # fmt: skip


class PackedFormat:
    """A format whose rows hold their own scales (see the module docstring's table)."""

    name: str
    storage_dtype: torch.dtype

    def row_size(self, head_size: int) -> int:
        """Elements (bytes) of a stored row of ``head_size`` values."""
        raise NotImplementedError

    def head_size(self, row_size: int) -> int:
        """The values a stored row of ``row_size`` bytes holds."""
        raise NotImplementedError

    def head_size_reason(self, head_size: int) -> str | None:
        """Why rows of ``head_size`` values cannot be stored (None: they can)."""
        return None

    def encode(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Rows ``[..., head_size]`` as stored: ``[..., row_size]`` of ``storage_dtype``."""
        raise NotImplementedError

    def decode(self, rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows ``[..., row_size]`` back as ``[..., head_size]`` values of ``dtype``."""
        raise NotImplementedError


def _tail_as(rows: torch.Tensor, start: int, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of ``rows`` from ``start`` on, reinterpreted as ``dtype`` (copied first: a slice
    of a row is generally not aligned for a wider type)."""
    return rows[..., start:].contiguous().view(dtype)


class Int8PerTokenHead(PackedFormat):
    name = "int8"
    storage_dtype = torch.int8

    def row_size(self, head_size: int) -> int:
        return head_size + 4

    def head_size(self, row_size: int) -> int:
        return row_size - 4

    def encode(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        s = xf.abs().amax(-1, keepdim=True) / 127.0
        # An all-zero row keeps scale 0 (it reads back as zeros); divide by 1 there instead.
        q = (xf / torch.where(s > 0, s, torch.ones_like(s))).round_().clamp_(-127, 127)
        return torch.cat([q.to(torch.int8), s.view(torch.int8)], dim=-1)

    def decode(self, rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = rows.shape[-1] - 4
        s = _tail_as(rows, d, torch.float32)
        # In float32, in place, rounded once to ``dtype``: decode runs every step over every cached
        # token, so it makes as few passes as it can (a mixed-dtype ``out=`` was slower still).
        return rows[..., :d].float().mul_(s).to(dtype)


class NvFp4(PackedFormat):
    name = "nvfp4"
    storage_dtype = torch.uint8
    block = 16

    def row_size(self, head_size: int) -> int:
        return head_size // 2 + head_size // self.block

    def head_size(self, row_size: int) -> int:
        # row = D/2 + D/16 = 9 D / 16
        return row_size * 16 // 9

    def head_size_reason(self, head_size: int) -> str | None:
        if head_size % self.block:
            return (
                f"kv_cache_dtype nvfp4 needs head_size to be a multiple of {self.block} (its "
                f"block-scale group), not {head_size}"
            )
        return None

    def encode(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        lead = x.shape[:-1]
        blocks = x.float().reshape(*lead, d // self.block, self.block)
        global_scale = scale.float() / _E2M1_MAX
        amax = blocks.abs().amax(-1, keepdim=True)
        block_scale = (amax / (_E2M1_MAX * global_scale)).clamp_(max=_E4M3_MAX)
        block_scale = block_scale.to(torch.float8_e4m3fn)
        step = block_scale.float() * global_scale
        y = blocks / torch.where(step > 0, step, torch.ones_like(step))
        mag = y.abs()
        code = torch.zeros(mag.shape, dtype=torch.uint8, device=x.device)
        for mid, tie_up in _E2M1_MIDPOINTS:
            code += (mag >= mid if tie_up else mag > mid).to(torch.uint8)
        code |= (y < 0).to(torch.uint8) << 3
        code = code.reshape(*lead, d // 2, 2)
        packed = code[..., 0] | (code[..., 1] << 4)
        return torch.cat([packed, block_scale.view(torch.uint8).reshape(*lead, -1)], dim=-1)

    def decode(self, rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = self.head_size(rows.shape[-1])
        lead = rows.shape[:-1]
        # Each byte looks up its two values at once (a 256-row table): no unpacking passes.
        pairs = torch.nn.functional.embedding(
            rows[..., : d // 2].int(), _E2M1_PAIRS.to(rows.device)
        )
        vals = pairs.view(*lead, d // self.block, self.block)
        step = _tail_as(rows, d // 2, torch.float8_e4m3fn).float() * (scale.float() / _E2M1_MAX)
        return vals.mul_(step[..., None]).view(*lead, d).to(dtype)


INT8 = Int8PerTokenHead()
NVFP4 = NvFp4()
PACKED_FORMATS: dict[str, PackedFormat] = {f.name: f for f in (INT8, NVFP4)}
_BY_STORAGE: dict[torch.dtype, PackedFormat] = {f.storage_dtype: f for f in PACKED_FORMATS.values()}
assert len(_BY_STORAGE) == len(PACKED_FORMATS), "each packed format needs its own element type"


def canonical_kv_cache_dtype(name: str) -> str:
    """``name`` as llmhal spells it (vLLM's ``fp8`` is ``fp8_e4m3``); an unknown name raises with
    the valid ones."""
    from llmhal.attention.backend import KV_CACHE_DTYPES

    got = KV_CACHE_DTYPE_ALIASES.get(name, name)
    if got not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={name!r} is not one of {', '.join(KV_CACHE_DTYPES)} (also accepted: "
            + ", ".join(f"{a} = {c}" for a, c in KV_CACHE_DTYPE_ALIASES.items())
            + ")"
        )
    return got


def packed_format(cache_dtype: str) -> PackedFormat | None:
    """The packed format a ``kv_cache_dtype`` names (None: values are stored one per element)."""
    return PACKED_FORMATS.get(cache_dtype)


def stored_format(rows: torch.Tensor) -> PackedFormat | None:
    """The packed format of a cache tensor (or rows read from one), by its element type."""
    return _BY_STORAGE.get(rows.dtype)


def storage_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of a cache of ``cache_dtype`` for a model computing in ``model_dtype``."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype in _FP8:
        return _FP8[cache_dtype]
    fmt = packed_format(cache_dtype)
    if fmt is None:
        canonical_kv_cache_dtype(cache_dtype)  # raises, naming the valid ones
        raise ValueError(f"kv_cache_dtype {cache_dtype!r} has no storage type")
    return fmt.storage_dtype


def row_size(cache_dtype: str, head_size: int) -> int:
    """The last dimension of a cache tensor that stores rows of ``head_size`` values."""
    fmt = packed_format(cache_dtype)
    return head_size if fmt is None else fmt.row_size(head_size)


def head_size_reason(cache_dtype: str, head_size: int) -> str | None:
    """Why ``cache_dtype`` cannot store rows of ``head_size`` values (None: it can)."""
    fmt = packed_format(cache_dtype)
    return None if fmt is None else fmt.head_size_reason(head_size)


def row_bytes(cache_dtype: str, head_size: int, model_dtype: torch.dtype) -> int:
    """Bytes one stored row of ``head_size`` values takes."""
    return row_size(cache_dtype, head_size) * storage_dtype(cache_dtype, model_dtype).itemsize


def encode(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """Rows as a cache of element type ``cache_dtype`` stores them (packed formats only)."""
    return _BY_STORAGE[cache_dtype].encode(x, scale)


def decode(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a packed cache, as values of ``dtype``."""
    return _BY_STORAGE[rows.dtype].decode(rows, scale, dtype)


@dataclass(frozen=True)
class KVBytesPerToken:
    """The KV cache a token takes: ``bytes`` in all, and the formula that gives it."""

    bytes: int
    formula: str


def kv_bytes_per_token(
    hf_config: Any, cache_dtype: str, model_dtype: torch.dtype
) -> KVBytesPerToken:
    """KV-cache bytes per token of a decoder from its HF config (every layer attends).

    MLA models (a ``kv_lora_rank`` in the config, DeepSeek-V2/V3) store one latent row a layer:
    ``layers * row_bytes(kv_lora_rank + qk_rope_head_dim)``; others store a key and a value row per
    KV head: ``2 * layers * kv_heads * row_bytes(head_dim)``. ``row_bytes`` is the table of the
    module docstring.
    """
    layers = int(hf_config.num_hidden_layers)
    item = str(storage_dtype(cache_dtype, model_dtype)).removeprefix("torch.")
    as_stored = cache_dtype if cache_dtype != "auto" else f"auto = {item}"
    if getattr(hf_config, "kv_lora_rank", None):
        latent = int(hf_config.kv_lora_rank) + int(hf_config.qk_rope_head_dim)
        row = row_bytes(cache_dtype, latent, model_dtype)
        return KVBytesPerToken(
            layers * row,
            f"{layers} layers x 1 latent row of {hf_config.kv_lora_rank} + "
            f"{hf_config.qk_rope_head_dim} values ({as_stored}: {row} B)",
        )
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
    row = row_bytes(cache_dtype, head_dim, model_dtype)
    return KVBytesPerToken(
        2 * layers * kv_heads * row,
        f"2 (K, V) x {layers} layers x {kv_heads} KV heads x a row of {head_dim} values "
        f"({as_stored}: {row} B)",
    )
