"""GGUF dequantization against the gguf package's reference (``gguf.quants.dequantize``), bit for bit.

Blocks are random bytes with valid (finite) fp16 scale fields, so every code, sub-scale and sign
pattern occurs; the simple formats are also checked on blocks ``gguf.quants.quantize`` produced.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from llmhal.quantization.gguf_dequant import (
    GGML_TYPES,
    GGUFRawWeight,
    dequantize,
    ggml_type,
    to_grouped,
)
from llmhal.testing.gguf_files import random_blocks

QUANTIZED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# Grouped form: (bits, group size), as documented in gguf_dequant.
GROUPED = {
    "Q4_0": (4, 32), "Q4_1": (4, 32), "Q5_0": (8, 32), "Q5_1": (8, 32), "Q8_0": (8, 32),
    "Q2_K": (4, 16), "Q3_K": (4, 16), "Q4_K": (4, 32), "Q5_K": (8, 32), "Q6_K": (8, 16),
}  # fmt: skip


def reference(raw: np.ndarray, name: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, T[name])))


def test_type_table_matches_gguf():
    for t in GGML_TYPES.values():
        assert gguf.GGML_QUANT_SIZES[T[t.name]] == (t.block_size, t.type_size), t.name
        assert int(T[t.name]) == t.type_id


@pytest.mark.parametrize("name", QUANTIZED)
def test_random_blocks_equal_reference(name):
    block_size = gguf.GGML_QUANT_SIZES[T[name]][0]
    rows, blocks_per_row = 6, 512 // block_size if block_size < 256 else 2
    raw = random_blocks(name, rows * blocks_per_row, seed=QUANTIZED.index(name))
    raw = raw.reshape(rows, -1)
    ref = reference(raw, name)
    ours = dequantize(torch.from_numpy(raw.copy()), name)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert torch.equal(ours, ref)
    # by type id too, and with extra leading dimensions
    raw3 = torch.from_numpy(raw.copy()).reshape(2, 3, -1)
    assert torch.equal(dequantize(raw3, int(T[name])).reshape(ref.shape), ref)


@pytest.mark.parametrize("name", QUANTIZED)
def test_grouped_form_is_exact(name):
    raw = random_blocks(name, 16, seed=100 + QUANTIZED.index(name)).reshape(4, -1)
    w = to_grouped(torch.from_numpy(raw.copy()), name)
    bits, group = GROUPED[name]
    assert (w.bits, w.group_size) == (bits, group)
    if bits == 4:
        assert w.qweight.dtype == torch.uint8 and int(w.qweight.max()) <= 15
    else:
        assert w.qweight.dtype == torch.int8
    assert torch.equal(w.dequantize(), reference(raw, name))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_blocks_quantized_by_gguf(name):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((8, 256)) * rng.uniform(0.01, 3, (8, 1))).astype(np.float32)
    raw = gguf.quants.quantize(x, T[name])
    ours = dequantize(torch.from_numpy(raw), name)
    assert torch.equal(ours, reference(raw, name))
    assert torch.equal(to_grouped(torch.from_numpy(raw), name).dequantize(), ours)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_passthrough(name):
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
    raw = x.to(dt).contiguous().view(torch.uint8)
    assert torch.equal(dequantize(raw, name), x.to(dt).float())
    assert torch.equal(dequantize(x.to(dt), name), x.to(dt).float())
    assert torch.equal(dequantize(raw, name), reference(raw.numpy(), name))


def test_unsupported_type_names_the_alternatives():
    with pytest.raises(ValueError, match=r"type 16 is not supported.*Q4_K"):
        ggml_type(16)  # IQ2_XXS
    with pytest.raises(ValueError, match="not a whole number of Q4_K blocks"):
        dequantize(torch.zeros(2, 100, dtype=torch.uint8), "Q4_K")
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize(torch.zeros(2, 36), "Q4_0")
    with pytest.raises(ValueError, match="not a whole number of Q4_0 blocks"):
        ggml_type("Q4_0").row_bytes(100)


def test_raw_weight_chunks_and_lookups():
    raw = torch.from_numpy(random_blocks("Q6_K", 40, seed=3).reshape(20, -1).copy())
    w = dequantize(raw, "Q6_K")
    kernel = GGUFRawWeight(raw, "Q6_K", 512)
    kernel.rows_per_chunk = 7  # several chunks, one partial
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(20, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(kernel(x, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    assert kernel(x.bfloat16()).dtype == torch.bfloat16
    ids = torch.tensor([[4, 0], [19, 4]])
    assert torch.equal(kernel.embedding(ids), w[ids])
    assert torch.equal(
        GGUFRawWeight(raw, "Q6_K", 512, torch.bfloat16).embedding(ids), w[ids].bfloat16()
    )
    assert torch.equal(kernel.dequantize(), w)
    assert kernel.weight_bytes() == raw.numel()
