"""Exact dequantization of GGUF (ggml) block formats, vectorised in torch, from raw block bytes.

Every supported block format is first *decomposed* into integer codes and per-group float scales and
offsets, ``w = scale * q + offset`` (see :class:`Decomposed`), computed in float32 with the same
operations, in the same order, as the reference (``gguf.quants.dequantize``), so that
:func:`dequantize` equals it bit for bit. That decomposition is also the normalised grouped form of
:mod:`llmhal.ops.quant_linear`: :func:`to_grouped` hands it to the platform's ``quant_linear`` kernel.
For every type here the products ``scale * q`` are exact in float32 (an fp16 scale times at most a
6-bit sub-scale times at most a 6-bit code), which is why re-basing unsigned codes (``q - 8`` becomes
``q`` with ``offset = -8 * scale``) does not change a single bit.

Layouts are llama.cpp's (``ggml-common.h``); one block holds ``block_size`` weights along a row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from llmhal.ops.quant_linear import GroupedQuantWeight, NativeQuantLinear

QK_K = 256  # the super-block of the K-quants


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type: ``block_size`` weights stored in ``type_size`` bytes."""

    name: str
    type_id: int
    block_size: int
    type_size: int

    @property
    def is_float(self) -> bool:
        return self.name in ("F32", "F16", "BF16")

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of ``k`` weights; a ``k`` that does not fill whole blocks is an error."""
        if k % self.block_size:
            raise ValueError(
                f"a row of {k} weights is not a whole number of {self.name} blocks "
                f"({self.block_size} weights each)"
            )
        return k // self.block_size * self.type_size


_TYPES = [
    GGMLType("F32", 0, 1, 4),
    GGMLType("F16", 1, 1, 2),
    GGMLType("Q4_0", 2, 32, 18),
    GGMLType("Q4_1", 3, 32, 20),
    GGMLType("Q5_0", 6, 32, 22),
    GGMLType("Q5_1", 7, 32, 24),
    GGMLType("Q8_0", 8, 32, 34),
    GGMLType("Q2_K", 10, QK_K, 84),
    GGMLType("Q3_K", 11, QK_K, 110),
    GGMLType("Q4_K", 12, QK_K, 144),
    GGMLType("Q5_K", 13, QK_K, 176),
    GGMLType("Q6_K", 14, QK_K, 210),
    GGMLType("BF16", 30, 1, 2),
]
GGML_TYPES: dict[int, GGMLType] = {t.type_id: t for t in _TYPES}
GGML_TYPES_BY_NAME: dict[str, GGMLType] = {t.name: t for t in _TYPES}
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def ggml_type(t: int | str | GGMLType) -> GGMLType:
    """The :class:`GGMLType` for a ggml type id or name; unsupported types list the supported ones."""
    if isinstance(t, GGMLType):
        return t
    found = GGML_TYPES_BY_NAME.get(t) if isinstance(t, str) else GGML_TYPES.get(int(t))
    if found is None:
        raise ValueError(
            f"GGUF tensor type {t!r} is not supported by llmhal; supported types: "
            f"{', '.join(GGML_TYPES_BY_NAME)}. Re-quantize the model to one of them "
            f"(llama.cpp's llama-quantize)."
        )
    return found


class Decomposed(NamedTuple):
    """Blocks as ``w[b, j] = scale[b, j // group_size] * q[b, j] + offset[b, j // group_size]``.

    ``q`` is uint8 or int8 ``[n_blocks, block_size]``; ``scale``/``offset`` are float32
    ``[n_blocks, block_size // group_size]``; ``offset`` None means zero. ``bits`` is the grouped
    form's width: 4 when the codes fit 0..15 once re-based (see :func:`to_grouped`), else 8.
    """

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group_size: int
    bits: int


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte ``start`` of every block, as float32 ``[n_blocks, 1]``."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _shift(x: torch.Tensor, shifts: list[int]) -> torch.Tensor:
    """``x[..., None, :] >> shifts`` (a new axis before the last, one entry per shift).

    Scalar shifts stacked: a shift by a broadcast tensor is about 10x slower on CPU.
    """
    return torch.stack([x >> s if s else x for s in shifts], dim=-2)


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """Low nibbles of each run of ``width`` bytes, then their high nibbles: ggml's 4-bit order."""
    nb = qs.shape[0]
    # Contiguous first: bit operations on strided uint8 views are several times slower.
    return (_shift(qs.contiguous().view(nb, -1, width), [0, 4]) & 0x0F).view(nb, -1)


def _bits(qh: torch.Tensor, width: int, count: int, mask: int) -> torch.Tensor:
    """Fields of ``8 // count`` bits: ``count`` shifts of each run of ``width`` bytes."""
    nb = qh.shape[0]
    step = 8 // count
    fields = _shift(qh.contiguous().view(nb, -1, width), list(range(0, 8, step)))
    return (fields & mask).view(nb, -1)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: eight 6-bit sub-block scales and mins packed in 12 bytes."""
    nb = scales.shape[0]
    s = scales.reshape(nb, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.to(torch.float32), mn.to(torch.float32)


def _q4_0(b: torch.Tensor) -> Decomposed:
    q = _nibbles(b[:, 2:], 16).to(torch.int8) - 8
    return Decomposed(q, _f16(b, 0), None, 32, 4)


def _q4_1(b: torch.Tensor) -> Decomposed:
    return Decomposed(_nibbles(b[:, 4:], 16), _f16(b, 0), _f16(b, 2), 32, 4)


def _q5(b: torch.Tensor, start: int) -> torch.Tensor:
    qh = b[:, start : start + 4].contiguous()
    qh = torch.stack([(qh >> i) & 1 for i in range(8)], dim=-1)  # [n, 4 bytes, 8 bits]
    qh = qh.view(b.shape[0], 32)  # bit j of the little-endian uint32
    return _nibbles(b[:, start + 4 :], 16) | (qh << 4)


def _q5_0(b: torch.Tensor) -> Decomposed:
    return Decomposed(_q5(b, 2).to(torch.int8) - 16, _f16(b, 0), None, 32, 8)


def _q5_1(b: torch.Tensor) -> Decomposed:
    return Decomposed(_q5(b, 4).to(torch.int8), _f16(b, 0), _f16(b, 2), 32, 8)


def _q8_0(b: torch.Tensor) -> Decomposed:
    return Decomposed(b[:, 2:].contiguous().view(torch.int8), _f16(b, 0), None, 32, 8)


def _q2_k(b: torch.Tensor) -> Decomposed:
    scales = b[:, :16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = d * (scales & 0x0F).to(torch.float32)
    ml = dmin * (scales >> 4).to(torch.float32)
    return Decomposed(_bits(b[:, 16:80], 32, 4, 3), dl, -ml, 16, 4)


def _q3_k(b: torch.Tensor) -> Decomposed:
    nb = b.shape[0]
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    low = (_shift(packed[:, :8], [0, 4]) & 0x0F).reshape(nb, 16)
    high = (_shift(packed[:, 8:12], [0, 2, 4, 6]) & 0x03).reshape(nb, 16)
    sc = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    ql = _bits(qs, 32, 4, 3).to(torch.int8)
    qh = _bits(hmask, 32, 8, 1) ^ 1  # a set mask bit means no -4
    return Decomposed(ql - (qh << 2).to(torch.int8), d * sc, None, 16, 4)


def _q4_k(b: torch.Tensor) -> Decomposed:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    return Decomposed(_nibbles(b[:, 16:], 32), d * sc, -(dmin * mn), 32, 4)


def _q5_k(b: torch.Tensor) -> Decomposed:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    q = _nibbles(b[:, 48:], 32) | (_bits(b[:, 16:48], 32, 8, 1) << 4)
    return Decomposed(q.to(torch.int8), d * sc, -(dmin * mn), 32, 8)


def _q6_k(b: torch.Tensor) -> Decomposed:
    nb = b.shape[0]
    ql = _nibbles(b[:, :128], 64).reshape(nb, 8, 32)
    qh = _bits(b[:, 128:192], 32, 4, 3).reshape(nb, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(nb, QK_K)
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    return Decomposed(q, _f16(b, 208) * scales, None, 16, 8)


_DECOMPOSERS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def decompose_blocks(blocks: torch.Tensor, t: int | str | GGMLType) -> Decomposed:
    """Decompose uint8 ``[n_blocks, type_size]`` blocks of quantized type ``t``."""
    gt = ggml_type(t)
    if gt.is_float:
        raise ValueError(f"{gt.name} is not a block-quantized type")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != gt.type_size:
        raise ValueError(
            f"{gt.name} blocks must be uint8 [n, {gt.type_size}], got {blocks.dtype} "
            f"{tuple(blocks.shape)}"
        )
    return _DECOMPOSERS[gt.name](blocks)


def _apply(dec: Decomposed) -> torch.Tensor:
    nb, n = dec.q.shape
    w = dec.q.to(torch.float32).view(nb, n // dec.group_size, dec.group_size)
    # In place: same IEEE results, and an out-of-place broadcast multiply is ~30x slower on CPU.
    w.mul_(dec.scale.unsqueeze(-1))
    if dec.offset is not None:
        w.add_(dec.offset.unsqueeze(-1))
    return w.view(nb, n)


def dequantize(
    raw: torch.Tensor, t: int | str | GGMLType, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Weights from raw GGUF data: uint8 ``[..., row_bytes]`` -> ``dtype`` ``[..., k]``.

    Float types (F32/F16/BF16) also accept a tensor already in their dtype (returned converted).
    The float32 result equals ``gguf.quants.dequantize`` exactly.
    """
    gt = ggml_type(t)
    if gt.is_float:
        if raw.dtype == torch.uint8:
            raw = raw.contiguous().view(_FLOAT_DTYPES[gt.name])
        return raw.to(dtype)
    if raw.dtype != torch.uint8:
        raise ValueError(f"raw {gt.name} data must be uint8 bytes, got {raw.dtype}")
    if raw.shape[-1] % gt.type_size:
        raise ValueError(
            f"{raw.shape[-1]} bytes per row is not a whole number of {gt.name} blocks "
            f"({gt.type_size} bytes each)"
        )
    lead = raw.shape[:-1]
    k = raw.shape[-1] // gt.type_size * gt.block_size
    w = _apply(decompose_blocks(raw.reshape(-1, gt.type_size), gt))
    return w.reshape(*lead, k).to(dtype)


def to_grouped(raw: torch.Tensor, t: int | str | GGMLType) -> GroupedQuantWeight:
    """The exact :class:`GroupedQuantWeight` form of a quantized ``[N, row_bytes]`` matrix."""
    gt = ggml_type(t)
    n = raw.shape[0]
    dec = decompose_blocks(raw.reshape(-1, gt.type_size), gt)
    q, scale, offset = dec.q, dec.scale, dec.offset
    if dec.bits == 4 and q.dtype == torch.int8:
        # Signed 4-bit codes (Q4_0: q-8, Q3_K: q-4) re-based to 0..15; exact (see module docstring).
        low = {"Q4_0": 8, "Q3_K": 4}[gt.name]
        q = (q + low).to(torch.uint8)
        offset = -(scale * low) if offset is None else offset - scale * low
    elif dec.bits == 8:
        q = q.to(torch.int8)
    return GroupedQuantWeight(
        qweight=q.reshape(n, -1),
        scale=scale.reshape(n, -1),
        offset=None if offset is None else offset.reshape(n, -1),
        group_size=dec.group_size,
        bits=dec.bits,
    )


class GGUFRawWeight(NativeQuantLinear):
    """A weight kept as the file's raw blocks, dequantized in row chunks on use (the exact path).

    ``raw`` is uint8 ``[N, row_bytes]`` for quantized types, or the float matrix ``[N, K]``.
    Products run in float32 (the chunked matmul is :class:`NativeQuantLinear`'s, over these rows),
    so the result is the reference the fast kernels are measured against.
    """

    name = "gguf_dequant"
    chunk_elems = 1 << 21  # weights dequantized at once (8 MiB of float32)

    def __init__(  # the grouped form is never built: rows come from the raw blocks
        self,
        raw: torch.Tensor,
        t: int | str | GGMLType,
        k: int,
        act_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.type = ggml_type(t)
        self.raw = raw.contiguous()
        self.shape = (raw.shape[0], k)
        self.act_dtype = act_dtype
        self.rows_per_chunk = max(1, self.chunk_elems // k)

    def weight_bytes(self) -> int:
        return self.raw.numel() * self.raw.element_size()

    def _rows(self, start: int, stop: int) -> torch.Tensor:
        return dequantize(self.raw[start:stop], self.type)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` only (a quantized embedding table is never expanded whole)."""
        rows = dequantize(self.raw.index_select(0, ids.reshape(-1)), self.type, self.act_dtype)
        return rows.view(*ids.shape, self.shape[1])
