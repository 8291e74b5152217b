"""The grouped weight-only quantized linear op (``quant_linear``), shared by GGUF, GPTQ, AWQ, ...

Every group-quantized integer weight format in llmhal is normalised to one form before it reaches a
kernel::

    w[n, k] = scale[n, k // group_size] * q[n, k] + offset[n, k // group_size]

with ``q`` unsigned 4-bit values in [0, 15] (``bits=4``) or signed 8-bit values (``bits=8``,
``offset`` None). GGUF Q4_0 is ``scale=d, offset=-8d``; Q4_1 is ``scale=d, offset=m``; GPTQ/AWQ are
``scale=s, offset=-z*s``; Q8_0 is ``bits=8, scale=d``. A format that does not fit (K-quants with
sub-block scales) dequantizes on its own.

The op is dispatched through the platform (``get_op("quant_linear")`` returns a kernel *class*): core's
:class:`NativeQuantLinear` keeps the weight packed and dequantizes it in row chunks per call; a
platform kernel may repack into its hardware's format. A platform kernel that cannot handle a given
weight must delegate to :class:`NativeQuantLinear` rather than fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class GroupedQuantWeight:
    """A weight in the normalised grouped form (see the module docstring). ``N x K`` logical shape."""

    qweight: torch.Tensor  # uint8 [N, K] in [0, 15] for bits=4; int8 [N, K] for bits=8
    scale: torch.Tensor  # float32 [N, K // group_size]
    offset: torch.Tensor | None  # float32 [N, K // group_size], or None (= 0)
    group_size: int
    bits: int

    def __post_init__(self) -> None:
        n, k = self.qweight.shape
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if k % self.group_size:
            raise ValueError(f"K={k} is not a multiple of group_size={self.group_size}")
        groups = (n, k // self.group_size)
        if tuple(self.scale.shape) != groups:
            raise ValueError(f"scale has shape {tuple(self.scale.shape)}, expected {groups}")
        if self.offset is not None and tuple(self.offset.shape) != groups:
            raise ValueError(f"offset has shape {tuple(self.offset.shape)}, expected {groups}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)  # type: ignore[return-value]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full-precision weight (the definition every kernel must agree with)."""
        return _dequant_rows(self.qweight, self.scale, self.offset, self.group_size).to(dtype)


def _dequant_rows(
    q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, g: int
) -> torch.Tensor:
    n, k = q.shape
    # In place on the fresh float copy: the out-of-place form allocates twice and is ~10x slower
    # for small groups (measured by the GGUF work, 16-wide K-quant groups).
    w = q.to(torch.float32).view(n, k // g, g).mul_(scale.unsqueeze(-1))
    if offset is not None:
        w.add_(offset.unsqueeze(-1))
    return w.view(n, k)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values in [0, 15] -> uint8 [N, K // 2] (low nibble = even column)."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`."""
    out = torch.empty(p.shape[0], p.shape[1] * 2, dtype=torch.uint8, device=p.device)
    out[:, 0::2] = p & 0x0F
    out[:, 1::2] = p >> 4
    return out


class NativeQuantLinear:
    """Reference kernel: keeps the weight packed; dequantizes ``rows_per_chunk`` rows at a time.

    Correct on every device; slow for decode because each call dequantizes the whole weight.
    """

    name = "native"
    rows_per_chunk = 2048

    def __init__(self, weight: GroupedQuantWeight, act_dtype: torch.dtype) -> None:
        self.shape = weight.shape
        self.bits = weight.bits
        self.group_size = weight.group_size
        self.act_dtype = act_dtype
        self.packed = (
            pack_nibbles(weight.qweight) if weight.bits == 4 else weight.qweight.contiguous()
        )
        self.scale = weight.scale.to(torch.float32).contiguous()
        self.offset = (
            None if weight.offset is None else weight.offset.to(torch.float32).contiguous()
        )

    @classmethod
    def supports(cls, weight: GroupedQuantWeight, act_dtype: torch.dtype) -> str | None:
        """None when this kernel can run ``weight``; otherwise the reason it cannot."""
        return None

    def weight_bytes(self) -> int:
        tensors = [self.packed, self.scale] + ([self.offset] if self.offset is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def _rows(self, start: int, stop: int) -> torch.Tensor:
        q = self.packed[start:stop]
        if self.bits == 4:
            q = unpack_nibbles(q)
        off = None if self.offset is None else self.offset[start:stop]
        return _dequant_rows(q, self.scale[start:stop], off, self.group_size)

    def dequantize(self) -> torch.Tensor:
        return self._rows(0, self.shape[0])

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantize only the rows in ``ids`` (quantized embedding tables)."""
        flat = ids.reshape(-1)
        q = self.packed.index_select(0, flat)
        if self.bits == 4:
            q = unpack_nibbles(q)
        off = None if self.offset is None else self.offset.index_select(0, flat)
        rows = _dequant_rows(q, self.scale.index_select(0, flat), off, self.group_size)
        return rows.to(self.act_dtype).view(*ids.shape, self.shape[1])

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n = self.shape[0]
        xf = x.to(torch.float32)
        outs = [
            F.linear(xf, self._rows(s, min(s + self.rows_per_chunk, n)))
            for s in range(0, n, self.rows_per_chunk)
        ]
        y = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.to(x.dtype)
