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
