"""On a real AMD GPU: the platform contract on the live device, and rocm_attn / rocm_aiter_fa
against core's reference backend (the shared attention conformance suite).

Marked ``gpu`` (excluded from the default run); every test skips cleanly without a ROCm device or
when a backend's library is not installed (its own reasons are shown).
"""

from __future__ import annotations

import pytest
import torch

from llmhal.testing.attention_conformance import check_attention_case, conformance_cases
from llmhal.testing.fixtures import live_platform
from llmhal.testing.platform_conformance import check_platform_instance
from llmhal_rocm.attention.rocm_aiter_fa import AiterFlashAttentionBackend
from llmhal_rocm.attention.rocm_attn import RocmAttentionBackend

pytestmark = pytest.mark.gpu


def _rocm_platform():
    return live_platform("rocm", torch.cuda.is_available() and bool(torch.version.hip), "ROCm")


def test_live_platform_conforms():
    platform = _rocm_platform()
    assert check_platform_instance(platform) == []
    # amdsmi's arch and HIP's must agree (the capability numbers come from the arch name).
    props = torch.cuda.get_device_properties(0)
    assert props.gcnArchName.split(":")[0] == platform.gcn_arch()


@pytest.mark.parametrize(
    "case", conformance_cases(RocmAttentionBackend, quick=False), ids=lambda c: c.id
)
def test_rocm_attn(case):
    check_attention_case(RocmAttentionBackend, case, device="cuda", platform=_rocm_platform())


@pytest.mark.parametrize("case", conformance_cases(AiterFlashAttentionBackend), ids=lambda c: c.id)
def test_rocm_aiter_fa(case):
    check_attention_case(AiterFlashAttentionBackend, case, device="cuda", platform=_rocm_platform())
