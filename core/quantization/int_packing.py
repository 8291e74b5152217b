"""Unpacking of the int32-packed integer weights used by GPTQ, AWQ and compressed-tensors.

All three store ``32 // bits`` unsigned values per int32 word, value ``i`` of a word in bits
``[i*bits, (i+1)*bits)`` (little-end first). They differ in the dimension that is packed and, for
AWQ, in the order of the values inside a word (``order[i]`` = which of the word's logical elements
sits in slot ``i``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# AWQ's GEMM kernels interleave a word's eight 4-bit values: slot i holds logical element
# AWQ_ORDER[i] (elements 0, 2, 4, 6 in the low slots, 1, 3, 5, 7 in the high ones).
AWQ_ORDER: tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(
    packed: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None
) -> torch.Tensor:
    """Expand ``packed`` (int32) along ``dim`` into unsigned ``bits``-bit values (uint8).

    The result has ``32 // bits`` times as many elements along ``dim``; element ``j*per + order[i]``
    comes from slot ``i`` of word ``j`` (``order`` defaults to slot ``i`` = element ``i``).
    """
    if packed.dtype != torch.int32:
        raise TypeError(f"packed weights must be int32, got {packed.dtype}")
    if bits not in (2, 4, 8):
        raise ValueError(f"cannot unpack {bits}-bit values from int32 words (2, 4 or 8 only)")
    per = 32 // bits
    mask = (1 << bits) - 1
    dim = dim % packed.dim()
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    # [..., words, per] with the slot axis right after the packed dimension.
    p = packed.unsqueeze(dim + 1)
    view = [1] * p.dim()
    view[dim + 1] = per
    slots = (p >> shifts.view(view)) & mask
    if order is not None:
        inverse = [0] * per
        for slot, element in enumerate(order):
            inverse[element] = slot
        slots = slots.index_select(dim + 1, torch.tensor(inverse, device=packed.device))
    shape = list(packed.shape)
    shape[dim] *= per
    return slots.reshape(shape).to(torch.uint8)
