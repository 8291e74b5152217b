"""The CPU ``fused_moe`` kernel against core's reference, unquantized and with int8 experts."""

from __future__ import annotations

import pytest
import torch

from llmhal.ops import fused_moe as core_moe
from llmhal_cpu import moe

E, H, INTER = 6, 64, 48
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("tokens", [1, 9])
def test_matches_the_reference(dtype, int8, tokens):
    torch.manual_seed(0)
    x, logits = torch.randn(tokens, H).to(dtype), torch.randn(tokens, E)
    if int8:
        w13 = torch.randint(-127, 128, (E, 2 * INTER, H), dtype=torch.int8)
        w2 = torch.randint(-127, 128, (E, H, INTER), dtype=torch.int8)
        scales = {"w13_scale": torch.rand(E, 2 * INTER) * 1e-3, "w2_scale": torch.rand(E, H) * 1e-2}
    else:
        w13, w2 = (
            (torch.randn(E, 2 * INTER, H) * 0.1).to(dtype),
            (torch.randn(E, H, INTER) * 0.1).to(dtype),
        )
        scales = {}
    got = moe.fused_moe(x, w13, w2, logits, 2, renormalize=False, **scales)
    ref = core_moe.fused_moe(x, w13, w2, logits, 2, renormalize=False, **scales)
    assert got.dtype == dtype and got.shape == ref.shape
    scale = ref.float().abs().max().clamp_min(1.0)
    assert float((got.float() - ref.float()).abs().max() / scale) < TOL[dtype]
