"""flashmla (FlashMLA decode) and the CUDA fused_moe op (FlashInfer's CUTLASS MoE) on this CPU
machine: registration, selection and refusal reasons, and the glue to each library through
pure-torch stand-ins bound to the upstream signatures (``upstream_api``), against core's MLA and
MoE references. The real libraries run in ``test_gpu.py`` (marked ``gpu``)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

from llmhal.attention import selector
from llmhal.attention.backend import AttentionRequirements
from llmhal.attention.registry import get_backend_entry
from llmhal.attention.selector import AttentionBackendError, select_attention_backend
from llmhal.ops import fused_moe as core_moe
from llmhal.testing.isolation import switched_platform
from llmhal.testing.signatures import bound_to
from llmhal_cuda import moe as cuda_moe
from llmhal_cuda import upstream_api
from llmhal_cuda.attention.flashmla import FlashMLABackend
from llmhal_cuda.platform import CudaPlatform

LATENT = 576  # DeepSeek's 512 + 64


def _module(name: str) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() sees it as installed
    return m


class Schedule:
    """What the stand-in's get_mla_metadata returns; flash_mla_with_kvcache checks it got it."""

    def __init__(self, seq_lens: torch.Tensor) -> None:
        self.seq_lens = seq_lens.clone()


def fake_flash_mla() -> types.ModuleType:
    m = _module("flash_mla")

    @bound_to(upstream_api.get_mla_metadata)
    def get_mla_metadata(a):
        assert a["cache_seqlens"].dtype == torch.int32 and a["num_heads_k"] == 1
        return Schedule(a["cache_seqlens"]), a["num_heads_per_head_k"]

    @bound_to(upstream_api.flash_mla_with_kvcache)
    def flash_mla_with_kvcache(a):
        q, cache, table, lens = (a[n] for n in ("q", "k_cache", "block_table", "cache_seqlens"))
        b, s_q, h, d = q.shape
        assert s_q == 1 and cache.dim() == 4 and cache.shape[2] == 1 and cache.shape[3] == d
        assert table.dtype == torch.int32 and lens.dtype == torch.int32 and lens.shape == (b,)
        sched, per_head_k = a["tile_scheduler_metadata"], a["num_splits"]
        assert isinstance(sched, Schedule) and torch.equal(sched.seq_lens, lens)
        assert per_head_k == h, "num_heads_per_head_k is s_q * h_q // h_kv"
        dv = a["head_dim_v"]
        page = cache.shape[1]
        out = torch.empty(b, 1, h, dv, dtype=q.dtype)
        for r in range(b):
            n = int(lens[r])
            pos = torch.arange(n)
            keys = cache[table[r, pos // page].long(), pos % page, 0].double()  # [n, D]
            scores = q[r, 0].double() @ keys.T * a["softmax_scale"]  # [H, n]
            out[r, 0] = (scores.softmax(-1) @ keys[:, :dv]).to(q.dtype)
        return out, torch.zeros(b, h, 1)

    m.get_mla_metadata = get_mla_metadata
    m.flash_mla_with_kvcache = flash_mla_with_kvcache
    return m


def fake_flashinfer_moe() -> tuple[types.ModuleType, types.ModuleType, list[dict]]:
    """``flashinfer`` with ``fused_moe.cutlass_fused_moe``: TensorRT-LLM's semantics (SwiGLU over
    fc1's up rows first, then its gate rows), in float64."""
    top, sub, calls = _module("flashinfer"), _module("flashinfer.fused_moe"), []

    @bound_to(upstream_api.cutlass_fused_moe)
    def cutlass_fused_moe(a):
        x, ids, scales = a["input"], a["token_selected_experts"], a["token_final_scales"]
        fc1, fc2 = a["fc1_expert_weights"], a["fc2_expert_weights"]
        assert ids.dtype == torch.int32 and scales.dtype == torch.float32
        assert a["quant_scales"] == [] and a["output_dtype"] == x.dtype
        calls.append(a)
        i = fc2.shape[-1]
        out = torch.zeros(x.shape[0], fc2.shape[1], dtype=torch.float64)
        for t in range(x.shape[0]):
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                h = fc1[e].double() @ x[t].double()
                up, gate = h[:i], h[i:]
                out[t] += float(scales[t, k]) * (
                    fc2[e].double() @ (torch.nn.functional.silu(gate) * up)
                )
        return out.to(a["output_dtype"])

    sub.cutlass_fused_moe = cutlass_fused_moe
    top.fused_moe = sub
    return top, sub, calls


@pytest.fixture
def cuda_platform(cuda_env, gpus, fake_inventory):
    with switched_platform() as use:
        yield lambda model: use(CudaPlatform(fake_inventory(getattr(gpus, model))))


@pytest.fixture
def flash_mla(monkeypatch):
    """``flash_mla(True)``: a FlashMLA stand-in importable; ``flash_mla(False)``: absent."""

    def install(present: bool) -> None:
        monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla() if present else None)

    install(False)
    return install


def _mla(dtype=torch.bfloat16, block_size=64, head_size=LATENT) -> AttentionRequirements:
    return AttentionRequirements(head_size, 16, 1, dtype, block_size=block_size, kind="mla")


# ------------------------------------------------------------------------------- flashmla
def test_flashmla_is_the_cuda_platforms_mla_backend(cuda_platform, flash_mla):
    assert get_backend_entry("flashmla").provider == "cuda"
    cuda_platform("H100")
    flash_mla(True)
    sel = select_attention_backend(_mla())
    assert sel.name == "flashmla" and sel.selected_by == "priority"


def test_flashmla_refusals_name_the_fix_and_core_mla_backends_follow(cuda_platform, flash_mla):
    cuda_platform("H100")
    sel = select_attention_backend(_mla())
    rejected = dict(sel.rejected)
    assert "flash_mla is not installed" in rejected["flashmla"][0]
    assert "github.com/deepseek-ai/FlashMLA" in rejected["flashmla"][0]
    assert sel.backend.kind == "mla" and sel.name != "flashmla"
    flash_mla(True)
    for req, words in (
        (_mla(block_size=16), "block_size 16"),
        (_mla(dtype=torch.float32), "float32"),
        (_mla(head_size=40), "head_size 40"),
    ):
        reasons = " ".join(dict(select_attention_backend(req).rejected)["flashmla"])
        assert words in reasons, (words, reasons)
    cuda_platform("A100")
    reasons = " ".join(dict(select_attention_backend(_mla()).rejected)["flashmla"])
    assert "9.0" in reasons or "9.x" in reasons


def test_an_mha_backend_named_for_an_mla_model_lists_flashmla(
    cuda_platform, flash_mla, monkeypatch
):
    cuda_platform("H100")
    flash_mla(True)
    selector._clear_cache_for_tests()
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "flash_attn")
    with pytest.raises(AttentionBackendError) as err:
        select_attention_backend(_mla())
    assert "flashmla" in str(err.value) and "torch_mla" in str(err.value)
    selector._clear_cache_for_tests()


def test_flashmla_glue_matches_dense_attention(flash_mla):
    """Two decodes beside a prefill chunk and a fresh prefill (test_mla's steps): decodes through
    the FlashMLA stand-in (the absorbed query over the paged latent, the schedule from
    get_mla_metadata), prefills through torch_mla's path."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2] / "tests" / "attention"))
    try:
        import test_mla as t
    finally:
        sys.path.pop(0)
    flash_mla(True)
    out, want = t.run_steps(FlashMLABackend, t.StubLayer(t.DIMS))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------------- fused_moe
def _moe_inputs(dtype=torch.bfloat16, e=6, h=32, i=16, t=5):
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * 0.2).to(dtype)
    return torch.randn(t, h, generator=g).to(dtype), w13, w2, torch.randn(t, e, generator=g)


def test_the_cuda_platform_brings_fused_moe():
    assert CudaPlatform.op_kernels["fused_moe"] == "llmhal_cuda.moe:fused_moe"
    # Experts held as per-expert kernels go to core's reference, never to this op.
    assert not getattr(cuda_moe.fused_moe, "accepts_expert_kernels", False)


def test_what_the_kernel_does_not_take_runs_core_grouped_path(monkeypatch):
    x, w13, w2, logits = _moe_inputs()
    assert "CUDA" in cuda_moe.kernel_declines(x, w13, "silu", None)  # CPU tensors
    assert "experts_int8" in cuda_moe.kernel_declines(x, w13, "silu", torch.ones(1))
    assert "gelu" in cuda_moe.kernel_declines(x, w13, "gelu", None)
    assert "float32" in cuda_moe.kernel_declines(x.float(), w13.float(), "silu", None)
    got = cuda_moe.fused_moe(x, w13, w2, logits, 2, num_expert_group=2, topk_group=1)
    want = core_moe.fused_moe(x, w13, w2, logits, 2, num_expert_group=2, topk_group=1)
    torch.testing.assert_close(got, want)


def test_missing_flashinfer_is_a_reason_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", None)
    assert "llmhal-cuda[flashinfer]" in cuda_moe.fused_moe.status()


def test_fused_moe_glue_matches_core_reference(monkeypatch):
    """Routing (grouped, renormalized, scaled) by core, the experts by the kernel stand-in: the
    up-first fc1 copy, int32 expert ids, float32 weights."""
    top, sub, calls = fake_flashinfer_moe()
    monkeypatch.setitem(sys.modules, "flashinfer", top)
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", sub)
    monkeypatch.setattr(cuda_moe, "kernel_declines", lambda *a: None)  # no CUDA device here
    x, w13, w2, logits = _moe_inputs(torch.float32)
    routing = {"num_expert_group": 3, "topk_group": 2, "routed_scaling_factor": 1.5}
    got = cuda_moe.fused_moe(x, w13, w2, logits, 2, **routing)
    want = core_moe.fused_moe(x, w13, w2, logits, 2, **routing)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(calls) == 1
    again = cuda_moe.fused_moe(x, w13, w2, logits, 2, **routing)
    assert calls[1]["fc1_expert_weights"] is calls[0]["fc1_expert_weights"]  # copied once
    torch.testing.assert_close(again, got)
    w13.mul_(2)  # new weights (a version bump): a new copy
    cuda_moe.fused_moe(x, w13, w2, logits, 2, **routing)
    assert calls[2]["fc1_expert_weights"] is not calls[0]["fc1_expert_weights"]
