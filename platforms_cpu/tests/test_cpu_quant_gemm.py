"""The native quant_gemm kernel and the CPU quant_linear dispatch, against the exact grouped weight.

References are float64 matmuls with the exactly dequantized weight (the definition
:class:`~llmhal.ops.quant_linear.NativeQuantLinear` implements) on the same input values. Bounds per
mode, as relative Frobenius errors: fp32 ~1e-7 measured (bound 2e-6); int16 ~2e-5 (x rounded to
int16 per block; bound 2e-4); int8 ~5e-3 (bound 3e-2).
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch

from llmhal.ops.quant_linear import GroupedQuantWeight, NativeQuantLinear
from llmhal_cpu import native_build
from llmhal_cpu.kernels import quant_gemm, quant_linear
from llmhal_cpu.kernels.quant_gemm import MODE_FP32, MODE_INT8, MODE_INT16, QuantGemm
from llmhal_cpu.kernels.quant_linear import CpuQuantLinear

TOL = {MODE_FP32: 2e-6, MODE_INT16: 2e-4, MODE_INT8: 3e-2}
GROUPS = (16, 32, 64, 128, 256, None)  # None: one group per row (per-channel)


@pytest.fixture(scope="module")
def lib():
    lib = quant_gemm.load_library()
    if lib is None:
        if native_build.compiler() is None:
            pytest.skip(f"no native kernel: {quant_gemm.kernel_status()}")
        pytest.fail(f"the kernel failed to build: {quant_gemm.kernel_status()}")
    return lib


def make_weight(n, k, g, bits, offset=True, seed=0, half=True):
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    groups = (n, k // g)
    scale = torch.rand(*groups, generator=gen) * 0.02 + 0.001
    off = torch.randn(*groups, generator=gen) * 0.05 if offset else None
    if half:  # GGUF stores fp16 scales: the kernel then keeps them as fp16
        scale = scale.half().float()
        off = None if off is None else off.half().float()
    return GroupedQuantWeight(q, scale, off, g, bits)


def rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: f"g{g or 'K'}")
@pytest.mark.parametrize("bits", [4, 8])
def test_every_mode_matches_the_exact_weight(lib, bits, group):
    # N with a tail inside a block of 16 and one past a pair of blocks; K with padding when the
    # whole row is one group (100 is no multiple of 32).
    for n, k in [(33, 3 * (group or 100)), (64 + 16, 2 * (group or 48))]:
        for offset in (True, False):
            w = make_weight(n, k, group or k, bits, offset, seed=n + k + bits)
            kernel = QuantGemm(w, lib)
            wd = w.dequantize().double()
            for m in (1, 3, 16, 65):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                ref = x.double() @ wd.T
                for mode, tol in TOL.items():
                    y = kernel(x, mode=mode)
                    assert y.dtype == torch.float32 and y.shape == (m, n)
                    err = rel(y, ref)
                    assert err < tol, (n, k, offset, m, mode, err)


def test_half_inputs_bias_batch_shapes_and_strides(lib):
    w = make_weight(40, 96, 32, 4)
    kernel = CpuQuantLinear(w, torch.bfloat16)
    assert kernel.name == "cpu_qgemm"
    bias = torch.randn(40, generator=torch.Generator().manual_seed(3))
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(2))
    wd = w.dequantize().double()
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dt)
        ref = xd.double() @ wd.T + bias.double()
        y = kernel(xd, bias)
        assert y.dtype == dt and y.shape == (2, 3, 40)
        # int16 activations (2e-5) plus rounding the output to the input's dtype
        assert rel(y, ref) < (2e-4 if dt == torch.float32 else 4e-3)
        # a bias in another dtype is taken as its fp32 value
        assert torch.equal(kernel(xd, bias.to(dt)), kernel(xd, bias.to(dt).float()))
    strided = torch.randn(5, 2 * 96, generator=torch.Generator().manual_seed(4))[:, ::2]
    assert rel(kernel(strided), strided.double() @ wd.T) < 2e-4
    empty = kernel(torch.zeros(0, 96))
    assert empty.shape == (0, 40)


def test_fp32_scales_when_fp16_would_round_them(lib):
    w = make_weight(48, 128, 32, 4, half=False, seed=7)
    kernel = QuantGemm(w, lib)
    assert kernel.scales.dtype == torch.float32
    assert QuantGemm(make_weight(48, 128, 32, 4), lib).scales.dtype == torch.float16
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(8))
    ref = x.double() @ w.dequantize().double().T
    for mode, tol in TOL.items():
        assert rel(kernel(x, mode=mode), ref) < tol
    assert torch.equal(kernel.rows(torch.arange(48)), w.dequantize())


@pytest.mark.parametrize("bits,half", [(4, True), (8, True), (4, False), (8, False)])
def test_row_lookups_are_exact(lib, bits, half):
    w = make_weight(50, 100, 100, bits, offset=bits == 4, half=half)  # padded N and K
    kernel = CpuQuantLinear(w, torch.float32)
    ids = torch.tensor([[49, 0, 17], [16, 31, 32]])
    assert torch.equal(kernel.embedding(ids), w.dequantize()[ids])
    assert torch.equal(kernel.dequantize(), w.dequantize())
    assert torch.equal(
        CpuQuantLinear(w, torch.bfloat16).embedding(ids), w.dequantize()[ids].bfloat16()
    )


def test_weight_bytes_stay_quantized(lib):
    w = make_weight(64, 256, 32, 4)
    # 4-bit codes and an fp16 (scale, offset) pair per group of 32: 5 bits a weight, as Q4_1
    assert CpuQuantLinear(w, torch.float32).weight_bytes() == 64 * 256 // 2 + 64 * 8 * 2 * 2
    w8 = make_weight(64, 256, 32, 8, offset=False)
    assert CpuQuantLinear(w8, torch.float32).weight_bytes() == 64 * 256 + 64 * 8 * 2  # as Q8_0


def test_results_do_not_depend_on_the_thread_count(lib, monkeypatch):
    # every call splits over the team, whatever the wait policy's threshold
    monkeypatch.setattr(quant_gemm, "MIN_PARALLEL_WORK", 0)
    w = make_weight(512, 256, 32, 4)
    kernel = QuantGemm(w, lib)
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(9))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [kernel(x, mode=m) for m in TOL]
        torch.set_num_threads(2)
        two = [kernel(x, mode=m) for m in TOL]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


def test_nan_and_inf_inputs_propagate(lib):
    kernel = QuantGemm(make_weight(40, 96, 32, 8), lib)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(13))
    x[0, 5], x[2, 70] = float("nan"), float("inf")
    for mode in TOL:
        y = kernel(x, mode=mode)
        assert y[0].isnan().all() and y[1].isfinite().all() and not y[2].isfinite().any(), mode


def test_blocks_too_small_to_scale_quantize_to_zero(lib):
    # 32767 / amax overflows for |x| < ~1e-34: those blocks count as zeros (not inf cast to int).
    kernel = QuantGemm(make_weight(40, 96, 32, 4), lib)
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(14))
    x[0, :32] = 1e-36  # one subnormal-scale block among normal ones
    ref = kernel(torch.cat([torch.zeros(1, 32), x[0:1, 32:]], dim=1), mode=MODE_INT16)
    for mode in (MODE_INT16, MODE_INT8):
        y = kernel(x, mode=mode)
        assert y.isfinite().all(), mode
    assert torch.equal(kernel(x, mode=MODE_INT16)[0], ref[0])


def test_integer_modes_do_not_depend_on_the_batch(lib):
    # Each row is quantized on its own and its block sums are exact integers, so a row's result is
    # the same whether it runs alone (decode) or with others (prefill, batched decode).
    w = make_weight(200, 576, 32, 4)
    kernel = QuantGemm(w, lib)
    x = torch.randn(65, 576, generator=torch.Generator().manual_seed(12))
    for mode in (MODE_INT16, MODE_INT8):
        full = kernel(x, mode=mode)
        assert torch.equal(full, torch.cat([kernel(x[i : i + 1], mode=mode) for i in range(65)]))
        # Every call height a tile takes whole (up to 8 rows: a verification of 7 drafts, a batch
        # of 8 decodes) and the splits of taller calls.
        for rows in range(2, 10):
            parts = [kernel(x[i : i + rows], mode=mode) for i in range(0, 65, rows)]
            assert torch.equal(full, torch.cat(parts)), (mode, rows)


def test_choices_and_their_names(lib, monkeypatch):
    w = make_weight(64, 128, 32, 4)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(10))
    ref = x.double() @ w.dequantize().double().T
    monkeypatch.setenv("LLMHAL_CPU_QUANT_KERNEL", "fp32")
    exact = CpuQuantLinear(w, torch.float32)
    assert exact.name == "cpu_qgemm (fp32)" and rel(exact(x), ref) < 2e-6
    monkeypatch.setenv("LLMHAL_CPU_QUANT_KERNEL", "native")
    native = CpuQuantLinear(w, torch.float32)
    assert native.name.startswith("native") and torch.equal(
        native(x), NativeQuantLinear(w, torch.float32)(x)
    )
    assert CpuQuantLinear.supports(w, torch.float32) == "LLMHAL_CPU_QUANT_KERNEL=native"
    monkeypatch.setenv("LLMHAL_CPU_QUANT_KERNEL", "int4pack")
    assert "int4pack" in quant_linear.status()
    monkeypatch.setenv("LLMHAL_CPU_QUANT_KERNEL", "fast")
    with pytest.raises(ValueError, match="LLMHAL_CPU_QUANT_KERNEL='fast'.*auto, fp32, int16"):
        CpuQuantLinear(w, torch.float32)
    monkeypatch.delenv("LLMHAL_CPU_QUANT_KERNEL")
    assert quant_linear.status().startswith("cpu_qgemm auto: ok (")
    assert CpuQuantLinear.supports(make_weight(8, 24, 8, 4), torch.float32) is not None  # g=8


def test_doctor_shows_what_quant_linear_runs(lib):
    from llmhal.doctor import collect

    (op,) = [o for o in collect()["ops"] if o["name"] == "quant_linear"]
    assert op["implementation"].endswith(":CpuQuantLinear")
    assert op["note"] == f"cpu_qgemm auto: ok ({quant_gemm.isa()})"


def test_small_groups_with_inexact_fp16_scales_keep_their_previous_paths(lib):
    # K-quant-like: sub-block scales that fp16 cannot hold would be fp32, over 1 bit a weight
    g16 = make_weight(64, 256, 16, 4, half=False)
    reason = CpuQuantLinear.supports(g16, torch.float32)
    assert "fp32 scales would add 4 bits per weight" in reason  # the gguf method dequantizes
    assert CpuQuantLinear(g16, torch.float32).name.startswith("native (its fp32 scales")
    g32 = make_weight(64, 256, 32, 4, half=False)
    assert CpuQuantLinear.supports(g32, torch.float32) is None
    assert CpuQuantLinear(g32, torch.float32).name.startswith("cpu_int4pack (its fp32 scales")
    assert (
        CpuQuantLinear(make_weight(64, 256, 128, 4, half=False), torch.float32).name == "cpu_qgemm"
    )


def test_without_a_compiler_the_torch_paths_run_and_say_why(monkeypatch, caplog):
    monkeypatch.setattr(quant_gemm.LIBRARY, "compiler", lambda: None)
    monkeypatch.setattr(quant_gemm.LIBRARY, "lib", None)
    monkeypatch.setattr(quant_gemm.LIBRARY, "status", None)
    monkeypatch.setattr(quant_linear, "_warned", type(quant_linear._warned)())
    w = make_weight(64, 128, 32, 4)
    with caplog.at_level(logging.WARNING, logger="llmhal"):
        kernel = CpuQuantLinear(w, torch.float32)
        CpuQuantLinear(w, torch.float32)
    warnings = [r for r in caplog.records if "quant_gemm kernel is unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0].getMessage()
    assert "no C++ compiler" in quant_linear.status() and "no C++ compiler" in kernel.name
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(11))
    assert rel(kernel(x), x.double() @ w.dequantize().double().T) < 1e-2
    odd = make_weight(40, 64, 16, 4)  # int4pack takes neither N=40 nor groups of 16
    fallback = CpuQuantLinear(odd, torch.float32)
    assert fallback.name.startswith("native") and hasattr(fallback, "embedding")


PORTABLE_CASES = [
    (4, 32, True, True),
    (4, 16, False, False),
    (8, 32, False, True),
    (8, 200, True, False),
]


def portable_outputs() -> tuple[str, dict]:
    """(isa, {case: (x, outputs per mode)}) of the library this process built."""
    lib = quant_gemm.load_library()
    assert lib is not None, quant_gemm.kernel_status()
    out = {}
    for case in PORTABLE_CASES:
        bits, g, off, half = case
        w = make_weight(33, 4 * g if g < 200 else g, g, bits, off, half=half)
        kernel = QuantGemm(w, lib)
        # 8 rows: one tile on AVX-512 (kMRI_ONE), two on AVX2 and the baseline build.
        x = torch.randn(8, w.shape[1], generator=torch.Generator().manual_seed(g))
        ys = {mode: kernel(x, mode=mode) for mode in TOL}
        ys["bf16"] = kernel(x.bfloat16(), mode=MODE_INT16)
        out[case] = (w, x, ys)
    return quant_gemm.isa(), out


@pytest.mark.parametrize(
    "arch,isa",
    [("-march=haswell", "avx2"), ("-march=alderlake", "avx2_vnni"), ("-march=x86-64", "scalar")],
    ids=["avx2", "avx2_vnni", "baseline"],
)
def test_portable_builds(lib, arch, isa, tmp_path):
    # The product must not assume AVX-512: build the AVX2+FMA code (with and without AVX-VNNI) and
    # the baseline x86-64 one (one library per process), and check every mode on them. Integer
    # products are exact, so their results must equal this host's build bit for bit.
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86-64 only")
    if isa == "avx2_vnni" and "avx_vnni" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX-VNNI")
    code = textwrap.dedent(
        f"""
        import torch
        from test_cpu_quant_gemm import portable_outputs
        torch.save(portable_outputs(), {str(tmp_path / "out.pt")!r})
        """
    )
    env = {**os.environ, "LLMHAL_CPU_KERNEL_ARCH": arch}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built_isa, theirs = torch.load(tmp_path / "out.pt", weights_only=False)
    assert built_isa == isa
    _, ours = portable_outputs()
    for case, (w, x, ys) in theirs.items():
        ref = x.double() @ w.dequantize().double().T
        for mode, tol in TOL.items():
            assert rel(ys[mode], ref) < tol, (case, mode)
        assert torch.equal(ys[MODE_INT16], ours[case][2][MODE_INT16]), case
        assert torch.equal(ys[MODE_INT8], ours[case][2][MODE_INT8]), case
        assert ys["bf16"].dtype == torch.bfloat16
        assert torch.equal(ys["bf16"], ours[case][2]["bf16"]), case


@pytest.mark.slow
def test_default_model_answers_like_the_exact_path(monkeypatch):
    """SmolLM2-135M-Instruct (Q4_1, tied Q8_0 head) on the default path: the chat answer names Paris,
    and the first 16 greedy tokens follow the exact path's (LLMHAL_GGUF_KERNEL=dequant) on 3 prompts.

    The kernel rounds activations to integers, so where the exact path's two best tokens are nearly
    tied the paths may part (in bf16 a story prompt parts at a 0.03 log-probability gap). Up to the
    first difference the tokens must be equal, and there the exact path must rank the kernel's token
    second within ``NEAR_TIE`` of its first: a real kernel error parts the paths at a clear choice."""
    NEAR_TIE = 0.1  # log-probability
    from llmhal import LLM, SamplingParams
    from llmhal.default_model import default_model_path

    try:
        model = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    plain = ["Once upon a time, in a small village,", "The three primary colors are"]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2)

    def answers(kernel_mode: str) -> list:
        monkeypatch.setenv("LLMHAL_GGUF_KERNEL", kernel_mode)
        llm = LLM(model, max_num_seqs=4)
        outs = llm.chat(chat, params) + llm.generate(plain, params)
        if kernel_mode == "auto":
            kernels = {
                k.name
                for m in llm.engine.model.modules()
                for k, _ in getattr(m, "quant_kernels", [])
            }
            assert kernels == {"cpu_qgemm"}, kernels
            assert "Paris" in outs[0].outputs[0].text, outs[0].outputs[0].text
        return [o.outputs[0] for o in outs]

    for fast, exact in zip(answers("auto"), answers("dequant"), strict=True):
        ours, theirs = list(fast.token_ids), list(exact.token_ids)
        parted = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None
        )
        if parted is None:
            assert ours == theirs
            continue
        ranked = sorted(exact.logprobs[parted].items(), key=lambda kv: -kv[1].logprob)
        (first, lp1), (second, lp2) = ranked[0], ranked[1]
        assert first == theirs[parted] and second == ours[parted], (parted, ours, theirs, ranked)
        assert lp1.logprob - lp2.logprob < NEAR_TIE, (parted, lp1.logprob, lp2.logprob)


def test_row_lookups_reject_ids_out_of_range(lib):
    kernel = QuantGemm(make_weight(48, 64, 32, 4), lib)
    for bad in ([48], [0, -1]):
        with pytest.raises(IndexError, match=r"\[0, 48\)"):
            kernel.rows(torch.tensor(bad))
    assert kernel.rows(torch.tensor([], dtype=torch.int64)).shape == (0, 64)
