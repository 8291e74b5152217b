"""The checks of ``ci/gpu-check``: one line per check, ``PASS``/``FAIL``/``SKIP`` and why.

Run by ``ci/gpu-check`` inside the environment it prepared (the image's torch, llmhal installed
beside it). ``--dry-run`` runs what a CPU can check (signature contracts of the libraries that are
installed, the Triton compile of the paged decode kernel for sm_90) and reports every GPU check as
SKIP, so the script's own code runs before the one chance on a GPU.

Each check is a function that returns a short detail or raises; a check that needs what is missing
raises :class:`Skip`. Exit status: 1 when any check failed.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

CHECKS: list[tuple[str, Callable[[], str]]] = []
DRY_RUN = False
INTERPRET = False  # set with --interpret (under TRITON_INTERPRET=1): Triton kernels on the CPU


class Skip(Exception):
    """The check cannot run here; the message says why."""


def check(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    def register(fn: Callable[[], str]) -> Callable[[], str]:
        CHECKS.append((name, fn))
        return fn

    return register


def need_gpu() -> Any:
    import torch

    if DRY_RUN or not torch.cuda.is_available():
        raise Skip("no CUDA device" + (" (dry run)" if DRY_RUN else ""))
    return torch


def rel_err(y: Any, ref: Any) -> float:
    y, ref = y.double(), ref.double()
    return float((y - ref).norm() / ref.norm())


def expect_close(label: str, y: Any, ref: Any, tol: float) -> str:
    err = rel_err(y, ref)
    if not err < tol:
        raise AssertionError(f"{label}: relative error {err:.2e} >= {tol:.0e}")
    return f"{label} {err:.1e}"


# ------------------------------------------------------------------------------------ facts
@check("device")
def device() -> str:
    torch = need_gpu()
    import triton

    p = torch.cuda.get_device_properties(0)
    return (
        f"{p.name} sm_{p.major}{p.minor} {p.total_memory >> 30} GiB, torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), triton {triton.__version__}"
    )


_VIEW = """
import json, os, torch
from llmhal_cuda.platform import CudaPlatform
p = CudaPlatform()
n = p.device_count()
ours = [(p.get_device_name(i), p.get_device_total_memory(i), p.device_capability(i).as_version_str())
        for i in range(n)]
theirs = []
for i in range(torch.cuda.device_count()):
    d = torch.cuda.get_device_properties(i)
    theirs.append((d.name, d.total_memory, f"{d.major}.{d.minor}"))
print(json.dumps({"ours": ours, "theirs": theirs}))
"""


@check("nvml-vs-cuda-views")
def device_views() -> str:
    torch = need_gpu()
    uuid = "GPU-" + str(torch.cuda.get_device_properties(0).uuid)
    settings = [None, "0", uuid, uuid[:12], "", "0,0", "1"]
    out = []
    for value in settings:
        env = dict(os.environ)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if value is not None:
            env["CUDA_VISIBLE_DEVICES"] = value
        run = subprocess.run(
            [sys.executable, "-c", _VIEW], env=env, capture_output=True, text=True, timeout=120
        )
        if run.returncode:
            raise AssertionError(f"CUDA_VISIBLE_DEVICES={value!r}: {run.stderr.strip()[-400:]}")
        views = json.loads(run.stdout.strip().splitlines()[-1])
        # torch reports total memory less what the driver reserves: names and capability must
        # agree exactly, memory within 2%.
        ours, theirs = views["ours"], views["theirs"]
        if len(ours) != len(theirs) or any(
            a[0] != b[0] or a[2] != b[2] or abs(a[1] - b[1]) > 0.02 * b[1]
            for a, b in zip(ours, theirs, strict=True)
        ):
            raise AssertionError(f"CUDA_VISIBLE_DEVICES={value!r}: llmhal {ours} != torch {theirs}")
        out.append(f"{value!r}:{len(ours)}")
    return "agree under " + " ".join(out)


# -------------------------------------------------------------------------------- contracts
@check("library-contracts")
def contracts() -> str:
    """Every GPU library found has the entry points llmhal calls, with compatible signatures."""
    import importlib

    from llmhal.testing.signatures import signature_drift
    from llmhal.utils.imports import is_available
    from llmhal_cuda import libraries, upstream_api

    reasons = {
        "flash_attn": libraries.flash_attn2_reason,
        "flash_attn_interface": libraries.flash_attn3_reason,
        "flashinfer": libraries.flashinfer_reason,
        "flashinfer.fused_moe": libraries.flashinfer_moe_reason,
        "flash_mla": libraries.flashmla_reason,
    }
    found, problems = [], []
    for key, (module, attr) in upstream_api.ENTRY_POINTS.items():
        if not is_available(module):
            continue
        why = reasons[module]()
        if why is not None:
            problems.append(why)
            continue
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        drift = signature_drift(getattr(upstream_api, key), obj)
        found.append(f"{module}.{attr}")
        problems += [f"{module}.{attr}: {d}" for d in drift]
    if libraries.fbgemm_distribution() is not None:
        why = libraries.fbgemm_genai_reason()
        if why is not None:
            problems.append(why)
        else:
            import torch

            for op in libraries.FBGEMM_OPS:
                schema = getattr(torch.ops.fbgemm, op).default._schema
                have = [a.name for a in schema.arguments]
                want = list(inspect.signature(getattr(upstream_api, op)).parameters)
                found.append(f"torch.ops.fbgemm.{op}")
                if have[: len(want)] != want:
                    problems.append(f"torch.ops.fbgemm.{op}: arguments {have}, expected {want}")
    if problems:
        raise AssertionError("; ".join(problems))
    if not found:
        raise Skip("no GPU library installed (flash-attn, flashinfer, fbgemm-gpu-genai)")
    return "match: " + ", ".join(found)


@check("paged-decode-compiles-sm90")
def paged_decode_compiles() -> str:
    """The decode kernel compiles for Hopper with Triton's own ptxas (runs on a CPU too)."""
    import torch

    from llmhal_rocm.attention.aot import compile_paged_decode

    for dtype in (torch.bfloat16, torch.float16):
        compile_paged_decode("sm_90", dtype)
    return "bf16, fp16"


# ------------------------------------------------------------------------------------ numerics
def _fp8_layer(config: Any, dtype: Any, tensors: dict[str, Any], n: int = 256, k: int = 512) -> Any:
    import torch

    from llmhal.testing.quant_layers import build_linear, finish, load_tensors

    with torch.device("cuda"):
        layer = build_linear(config, "replicated", in_features=k, out_features=n, dtype=dtype)
    load_tensors(layer, {name: t.cuda() for name, t in tensors.items()})
    return finish(layer)


def _fp8_weight(n: int = 256, k: int = 512, per_row: bool = True) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g)
    scale = w.abs().amax(dim=1, keepdim=True) / 448 if per_row else w.abs().amax() / 448
    return (w / scale).to(torch.float8_e4m3fn), scale.float()


@check("fbgemm-fp8")
def fbgemm_fp8() -> str:
    torch = need_gpu()
    from llmhal.platforms import get_current_platform
    from llmhal_cuda.libraries import fbgemm_genai_reason
    from llmhal_cuda.quantization.fbgemm_fp8 import FBGEMMFp8Config

    if torch.cuda.get_device_capability() < (9, 0):
        raise Skip("f8f8bf16_rowwise needs compute capability 9.0+")
    why = fbgemm_genai_reason()
    if why is not None:
        raise AssertionError(f"FBGEMM not usable: {why}")
    assert get_current_platform().name == "cuda", get_current_platform().name
    w8, ws = _fp8_weight()
    out = []
    for dtype in (torch.bfloat16, torch.float16):
        layer = _fp8_layer(FBGEMMFp8Config(None, 1200.0), dtype, {"weight": w8, "weight_scale": ws})
        assert layer.fbgemm_rowwise, layer.quant_method.describe(layer)
        x = torch.randn(16, 512, device="cuda").to(dtype)
        xs = torch.randn(16, 1024, device="cuda").to(dtype)[:, ::2]  # strided activation
        for label, inp in ((str(dtype)[6:], x), (f"{str(dtype)[6:]}-strided", xs)):
            # FBGEMM quantizes the bf16 activations per row (amax / 448, the bound far above).
            xb = inp.to(torch.bfloat16).float()
            sx = xb.abs().amax(dim=1, keepdim=True) / 448
            xq = (xb / sx).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sx
            ref = xq @ (w8.float() * ws).cuda().T
            out.append(expect_close(label, layer(inp).float(), ref, 2e-2))
    return ", ".join(out)


@check("modelopt-fp8-scaled-mm")
def modelopt_fp8() -> str:
    torch = need_gpu()
    from llmhal_cuda.quantization.modelopt import ModelOptConfig

    if torch.cuda.get_device_capability() < (8, 9):
        raise Skip("fp8 matmuls need compute capability 8.9+")
    w8, ws = _fp8_weight(per_row=False)
    cfg = ModelOptConfig.from_config({"quantization": {"quant_algo": "FP8"}})
    out = []
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(16, 512, device="cuda").to(dtype)
        in_scale = (x.float().abs().max() / 448).reshape(())
        tensors = {"weight": w8, "weight_scale": ws.reshape(()), "input_scale": in_scale.cpu()}
        layer = _fp8_layer(cfg, dtype, tensors)
        assert layer.fp8_mode == "scaled_mm", layer.quant_method.describe(layer)
        xq = (x.float() / in_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * in_scale
        ref = xq @ (w8.float() * ws).cuda().T
        out.append(expect_close(str(dtype)[6:], layer(x).float(), ref, 1e-2))
    return ", ".join(out)


@check("tinygemm-int4")
def tinygemm() -> str:
    torch = need_gpu()
    from llmhal.ops.quant_linear import GroupedQuantWeight
    from llmhal_cuda.quantization.int4_tinygemm import TinygemmInt4Linear

    g = torch.Generator().manual_seed(3)
    n, k = 256, 1024
    out = []
    for group in (32, 64, 128, 256):
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = torch.rand(n, k // group, generator=g) * 0.01 + 0.001
        offset = -torch.randint(0, 16, (n, k // group), generator=g).float() * scale
        weight = GroupedQuantWeight(q.cuda(), scale.cuda(), offset.cuda(), group, 4)
        kernel = TinygemmInt4Linear(weight, torch.bfloat16)
        ref_w = weight.dequantize().float()
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(8, 2 * k, generator=g).to(dtype).cuda()[:, ::2]  # strided
            ref = x.float() @ ref_w.T
            expect_close(f"g{group} {dtype}", kernel(x).float(), ref, 2e-2)
        out.append(f"g{group}")
    return "bf16+fp16 strided inputs, " + " ".join(out)


def _decode_reference(q: Any, cache: Any, table: Any, lens: Any, scale: float, window: int | None,
                      cap: float | None) -> Any:  # fmt: skip
    import torch

    out = torch.empty_like(q, dtype=torch.float32)
    block = cache.shape[2]
    group = q.shape[1] // cache.shape[3]
    for r in range(q.shape[0]):
        n = int(lens[r])
        pages = table[r, : -(-n // block)].long()
        k = cache[0][pages].reshape(-1, *cache.shape[3:])[:n].float().repeat_interleave(group, 1)
        v = cache[1][pages].reshape(-1, *cache.shape[3:])[:n].float().repeat_interleave(group, 1)
        s = torch.einsum("hd,khd->hk", q[r].float(), k) * scale
        if cap:
            s = cap * torch.tanh(s / cap)
        if window:
            s[:, : max(0, n - window)] = float("-inf")
        out[r] = torch.einsum("hk,khd->hd", s.softmax(-1), v)
    return out


@check("paged-decode-numerics")
def paged_decode_numerics() -> str:
    """The decode kernel against a torch reference in bf16/fp16 with windows and soft-cap. In a dry
    run the same check runs in Triton's interpreter on the CPU (a subprocess: Triton reads
    TRITON_INTERPRET when the kernel module is imported), which exercises this check's code."""
    import torch

    if DRY_RUN:
        env = dict(os.environ, TRITON_INTERPRET="1")
        run = subprocess.run(
            [sys.executable, __file__, "--interpret", "--only", "paged-decode-numerics"],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        line = next((x for x in run.stdout.splitlines() if "paged-decode-numerics" in x), "")
        if not line.startswith("PASS"):
            raise AssertionError(f"in the interpreter: {line or run.stderr[-600:]}")
        return "in Triton's interpreter on the CPU: " + line.split(": ", 1)[1]
    device = "cpu" if INTERPRET else need_gpu() and "cuda"
    from llmhal_rocm.attention.paged_decode import paged_decode

    g = torch.Generator().manual_seed(5)
    out = []
    for dtype in (torch.bfloat16, torch.float16):
        for window, cap in ((None, None), (64, None), (None, 30.0), (48, 20.0)):
            b, h, kvh, d, block = 3, 16, 4, 128, 16
            lens = torch.tensor([1, 97, 700 if not INTERPRET else 200], dtype=torch.int32)
            need = [-(-int(n) // block) for n in lens]
            blocks = sum(need) + 2
            cache = torch.randn(2, blocks, block, kvh, d, generator=g).to(dtype)
            perm = torch.randperm(blocks, generator=g).int()
            table = torch.zeros(b, max(need), dtype=torch.int32)
            start = 0
            for r, m in enumerate(need):  # each request its own pages, scattered
                table[r, :m] = perm[start : start + m]
                start += m
            q = torch.randn(b, h, d, generator=g).to(dtype)
            one = torch.ones((), dtype=torch.float32)
            y = paged_decode(q.to(device), cache.to(device), table.to(device), lens.to(device),
                             int(lens.max()), d**-0.5, one.to(device), one.to(device),
                             sliding_window=window, logits_soft_cap=cap)  # fmt: skip
            ref = _decode_reference(q, cache, table, lens, d**-0.5, window, cap)
            expect_close(f"{dtype} w{window} c{cap}", y.float().cpu(), ref, 1e-2)
        out.append(str(dtype)[6:])
    return ", ".join(out) + " x (full, window, soft-cap, both)"


# ------------------------------------------------------------------------------------- runner
def main(argv: list[str] | None = None) -> int:
    global DRY_RUN
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU: run what needs no GPU")
    parser.add_argument("--only", nargs="*", default=None, help="check names to run")
    parser.add_argument("--interpret", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    DRY_RUN = args.dry_run
    global INTERPRET
    INTERPRET = args.interpret
    failed = 0
    for name, fn in CHECKS:
        if args.only and name not in args.only:
            continue
        t0 = time.monotonic()
        try:
            detail, status = fn(), "PASS"
        except Skip as e:
            detail, status = str(e), "SKIP"
        except Exception as e:
            status, failed = "FAIL", failed + 1
            tb = traceback.format_exception(type(e), e, e.__traceback__)
            detail = f"{type(e).__name__}: {e}\n" + "".join(tb[-3:])
        print(f"{status} {name} ({time.monotonic() - t0:.1f} s): {detail}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
