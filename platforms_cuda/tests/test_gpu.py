"""On a real NVIDIA GPU: the platform contract on the live device and the real flash_attn/flashinfer
libraries against core's reference backend (the shared attention conformance suite).

Marked ``gpu`` (excluded from the default run); every test skips cleanly without a CUDA device, on
another platform, or when the library is not installed (the backend's own reasons are shown).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llmhal.testing.attention_conformance import check_attention_case, conformance_cases
from llmhal.testing.fixtures import live_platform
from llmhal.testing.platform_conformance import check_platform_instance
from llmhal_cuda.attention.flash_attn import FlashAttentionBackend
from llmhal_cuda.attention.flashinfer import FlashInferBackend

pytestmark = pytest.mark.gpu


def _cuda_platform():
    return live_platform("cuda", torch.cuda.is_available(), "CUDA")


def test_live_platform_conforms():
    platform = _cuda_platform()
    assert check_platform_instance(platform) == []
    free, total = platform.mem_get_info()
    torch_free, torch_total = torch.cuda.mem_get_info(0)
    assert total == torch_total
    assert abs(free - torch_free) < total // 20  # NVML and the runtime see the same device
    assert tuple(platform.device_capability()) == torch.cuda.get_device_capability(0)


@pytest.mark.parametrize("case", conformance_cases(FlashAttentionBackend), ids=lambda c: c.id)
def test_flash_attn(case):
    check_attention_case(FlashAttentionBackend, case, device="cuda", platform=_cuda_platform())


@pytest.mark.parametrize("case", conformance_cases(FlashAttentionBackend)[:3], ids=lambda c: c.id)
def test_flash_attn_page_size_256(case):
    # FA2 reads pages directly only when they are multiples of 256 tokens.
    case = replace(case, block_size=256)
    check_attention_case(FlashAttentionBackend, case, device="cuda", platform=_cuda_platform())


@pytest.mark.parametrize("case", conformance_cases(FlashInferBackend), ids=lambda c: c.id)
def test_flashinfer(case):
    check_attention_case(FlashInferBackend, case, device="cuda", platform=_cuda_platform())


class _MLALayer:
    """What an MLA impl reads from its layer (DeepSeek-V3's sizes, 16 heads)."""

    def __init__(self) -> None:
        from llmhal.attention.mla.common import MLADims

        g = torch.Generator(device="cuda").manual_seed(0)
        self.dims = d = MLADims(16, 128, 64, 128, 512)
        self.w_uk = torch.randn(16, d.qk_nope_head_dim, 512, generator=g, device="cuda") * 0.05
        self.w_uv = torch.randn(16, d.v_head_dim, 512, generator=g, device="cuda") * 0.05
        self.k_scale = self.v_scale = torch.tensor(1.0, device="cuda")

    def mla_weights(self, dtype, device):
        return self.w_uk.to(dtype), self.w_uv.to(dtype)


def test_flashmla_decode_matches_torch_mla():
    """Eight decodes of different lengths over a shuffled bf16 latent cache of 64-token pages:
    FlashMLA's kernel against torch_mla's batched torch decode."""
    from llmhal.attention.backend import AttentionRequirements
    from llmhal.attention.batch import build_common_metadata
    from llmhal.attention.mla.torch_mla import TorchMLABackend
    from llmhal_cuda.attention.flashmla import FlashMLABackend

    platform = _cuda_platform()
    cap = tuple(torch.cuda.get_device_capability(0))
    req = AttentionRequirements(576, 16, 1, torch.bfloat16, block_size=64, kind="mla",
                                device_capability=cap)  # fmt: skip
    reasons = FlashMLABackend.validate(req, platform)
    if reasons:
        pytest.skip("; ".join(reasons))
    layer, g = _MLALayer(), torch.Generator(device="cuda").manual_seed(1)
    lens = [1, 7, 64, 65, 130, 300, 513, 1000]
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    tables, used = [], 0
    for n in lens:
        count = -(-n // 64)
        tables.append(perm[used : used + count])
        used += count
    cache = torch.randn(64, 64, 576, generator=g, device="cuda").to(torch.bfloat16)
    common = build_common_metadata([1] * len(lens), [n - 1 for n in lens], tables, 64, "cuda")
    q = torch.randn(len(lens), 16, 192, generator=g, device="cuda").to(torch.bfloat16)
    c = torch.randn(len(lens), 512, generator=g, device="cuda").to(torch.bfloat16)
    k_pe = torch.randn(len(lens), 64, generator=g, device="cuda").to(torch.bfloat16)
    outs = []
    for backend in (FlashMLABackend, TorchMLABackend):
        impl = backend.get_impl_cls()(16, 576, 192**-0.5, 1)
        meta = backend.get_builder_cls()(req, torch.device("cuda")).build(common)
        outs.append(impl.forward(layer, q, c, k_pe, cache.clone(), meta).float())
    rel = float((outs[0] - outs[1]).abs().max() / outs[1].abs().max())
    assert rel < 2e-2, rel


def test_cuda_fused_moe_matches_core():
    """FlashInfer's CUTLASS MoE (bf16, DeepSeek-style grouped routing) against core's grouped
    implementation on the same device."""
    from llmhal.ops import fused_moe as core_moe
    from llmhal_cuda import moe as cuda_moe

    _cuda_platform()
    g = torch.Generator(device="cuda").manual_seed(0)
    e, h, i, t = 16, 1024, 512, 37
    x = torch.randn(t, h, generator=g, device="cuda").to(torch.bfloat16)
    w13 = (torch.randn(e, 2 * i, h, generator=g, device="cuda") * 0.03).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g, device="cuda") * 0.03).to(torch.bfloat16)
    logits = torch.randn(t, e, generator=g, device="cuda")
    why = cuda_moe.kernel_declines(x, w13, "silu", None)
    if why is not None:
        pytest.skip(why)
    routing = {"num_expert_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}
    got = cuda_moe.fused_moe(x, w13, w2, logits, 4, **routing).float()
    want = core_moe.fused_moe(x, w13, w2, logits, 4, **routing).float()
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < 2e-2, rel
