"""Behaviour checks of a platform's contributions: each one is run, not just imported.

The class-level suite (:mod:`llmhal.testing.platform_conformance`) proves that every declared class
path imports and has the right type; a backend whose implementation module is missing still passes
it. These checks run what the engine would run, on the platform's device:

* **attention backends**: ``get_builder_cls()``/``get_impl_cls()``, metadata built for a prefill and
  for a mixed decode + prefill step over a shuffled paged cache, outputs compared with the
  pure-torch ``reference`` backend (:mod:`llmhal.testing.attention_conformance`);
* **op kernels**: each kernel against the op of the same name in :mod:`llmhal.ops.native` (for
  ``quant_linear``, against :class:`~llmhal.ops.quant_linear.NativeQuantLinear`), in every model
  dtype the platform supports;
* **quantization methods**: a tiny linear layer built under the method, its parameters filled,
  ``process_weights_after_loading`` run and a forward pass checked for shape, dtype and finite
  values. A method whose ``from_config({})`` cannot build a config needs an example config.

Each check returns a :class:`Finding` naming the contribution, so a failure says which one broke.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from llmhal.platforms import Platform
from llmhal.utils.imports import resolve_obj_by_qualname

# (atol, rtol) of op kernels against the native ops, per dtype: the native definitions reduce in
# float32, so a kernel may differ by rounding order only.
OP_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
# quant_linear kernels may quantize activations (see llmhal_cpu's int16 path): Frobenius-relative.
QUANT_LINEAR_REL_ERR = 1e-2
CHECKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Finding:
    """What one contribution did under test. Empty ``problems`` and ``skipped``: it passed."""

    kind: str  # "attention backend", "op kernel", "quantization method"
    name: str
    problems: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.kind} {self.name!r}"

    def describe(self) -> str:
        if self.problems:
            return f"{self.label} FAILED:\n" + "".join(f"  - {p}\n" for p in self.problems)
        if self.skipped:
            return f"{self.label} skipped: " + "; ".join(self.skipped)
        return f"{self.label} passed"


def _load(kind: str, name: str, path: str) -> tuple[Any, Finding | None]:
    try:
        return resolve_obj_by_qualname(path), None
    except Exception as e:
        return None, Finding(kind, name, (f"{path} does not import: {type(e).__name__}: {e}",))


def _dtypes(platform: Platform) -> list[torch.dtype]:
    return [d for d in CHECKED_DTYPES if d in platform.supported_dtypes]


# ------------------------------------------------------------------------------------- attention
def check_attention_backend(platform: Platform, name: str, *, quick: bool = True) -> Finding:
    """Prefill and decode through the backend's own builder and implementation, against
    ``reference``; cases the backend's ``validate`` rejects are skipped with its reasons."""
    from llmhal.testing.attention_conformance import run_attention_conformance

    kind = "attention backend"
    backend, bad = _load(kind, name, platform.attention_backends[name])
    if bad:
        return bad
    if getattr(backend, "kind", None) == "mla":  # the latent cache: MLA's own workload
        from llmhal.testing.mla_steps import check_mla_backend

        dtypes = [
            d
            for d in _dtypes(platform)
            if str(d).removeprefix("torch.") in backend.supported_dtypes
        ]
        return Finding(
            kind, name, tuple(check_mla_backend(backend, platform.torch_device(), dtypes))
        )
    report = run_attention_conformance(
        backend,
        device=platform.torch_device(),
        dtypes=[str(d).removeprefix("torch.") for d in _dtypes(platform)] or None,
        quick=quick,
        platform=platform,
    )
    problems = tuple(f"{r.case.id}: " + "; ".join(r.failures) for r in report.failed)
    ran = [r for r in report.results if not r.skipped]
    skipped: tuple[str, ...] = ()
    if not problems and not ran:
        skipped = tuple(f"{r.case.id}: " + "; ".join(r.skipped) for r in report.skipped)
    return Finding(kind, name, problems, skipped)


# ------------------------------------------------------------------------------------------- ops
def _op_inputs(op: str, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> Any:
    """Arguments of ``op`` (signatures in llmhal.ops.native), or None for an op without a case."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    tokens, hidden = 7, 96
    if op == "rms_norm":
        return [(rand(tokens, hidden), rand(hidden), 1e-6)]
    if op == "fused_add_rms_norm":
        return [(rand(tokens, hidden), rand(tokens, hidden), rand(hidden), 1e-5)]
    if op == "silu_and_mul":
        return [(rand(tokens, 2 * hidden),)]
    if op == "rotary_embedding":
        head, heads, kv_heads, rot, max_pos = 64, 4, 2, 64, 64
        positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
        inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
        freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
        cache = torch.cat((freqs.cos(), freqs.sin()), -1).to(device, dtype)
        return [
            (
                positions,
                rand(tokens, heads * head),
                rand(tokens, kv_heads * head),
                cache,
                head,
                neox,
            )
            for neox in (True, False)
        ]
    if op == "fused_moe":
        experts, inter, top_k = 6, 48, 2
        return [
            (rand(t, hidden), rand(experts, 2 * inter, hidden) * 0.1,
             rand(experts, hidden, inter) * 0.1, rand(t, experts), top_k)
            for t in (1, tokens)
        ]  # fmt: skip
    return None


def _close(out: Any, ref: Any, dtype: torch.dtype) -> str | None:
    outs = out if isinstance(out, tuple | list) else (out,)
    refs = ref if isinstance(ref, tuple | list) else (ref,)
    if len(outs) != len(refs):
        return f"returned {len(outs)} tensors, the native op {len(refs)}"
    atol, rtol = OP_TOLERANCES[dtype]
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        where = f"output {i}: " if len(refs) > 1 else ""
        if not isinstance(o, torch.Tensor):
            return f"{where}returned {type(o).__name__}, not a tensor"
        if o.shape != r.shape or o.dtype != r.dtype:
            return f"{where}{tuple(o.shape)} {o.dtype} != native {tuple(r.shape)} {r.dtype}"
        err = (o.float().cpu() - r.float().cpu()).abs()
        bad = ~(err <= atol + rtol * r.float().cpu().abs())
        if bool(bad.any()):
            return (
                f"{where}{int(bad.sum())} of {bad.numel()} values differ from the native op "
                f"(max |err| {float(err.nan_to_num(float('inf')).max()):.3g}, atol={atol}, rtol={rtol})"
            )
    return None


def _clone(args: tuple[Any, ...]) -> tuple[Any, ...]:
    # Kernels may write their result into the inputs (rotary_embedding does), so each side gets
    # its own copy.
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _check_function_op(op: str, kernel: Callable[..., Any], platform: Platform) -> list[str]:
    from llmhal.ops.registry import CORE_OPS

    native = resolve_obj_by_qualname(CORE_OPS[op])
    device = platform.torch_device()
    out: list[str] = []
    for dtype in _dtypes(platform):
        cases = _op_inputs(op, dtype, device, torch.Generator().manual_seed(0))
        for i, args in enumerate(cases or ()):
            label = f"{str(dtype).removeprefix('torch.')}" + (
                f" case {i}" if len(cases) > 1 else ""
            )
            try:
                got = kernel(*_clone(args))
            except Exception as e:
                out.append(f"{label}: raised {type(e).__name__}: {e}")
                continue
            why = _close(got, native(*_clone(args)), dtype)
            if why:
                out.append(f"{label}: {why}")
            if op == "fused_moe" and getattr(kernel, "accepts_expert_kernels", False):
                why = _check_expert_kernels(kernel, native, args, dtype)
                if why:
                    out.append(f"{label}, experts as ExpertKernels: {why}")
    return out


def _check_expert_kernels(
    kernel: Callable[..., Any], native: Callable[..., Any], args: tuple[Any, ...], dtype: Any
) -> str | None:
    """A ``fused_moe`` that declares ``accepts_expert_kernels`` given the experts as per-expert
    kernels (what quantized experts arrive as) must equal the native op on the stacked weights."""
    import torch.nn.functional as F

    from llmhal.ops.expert_kernels import ExpertKernels

    x, w13, w2, *rest = _clone(args)
    k13 = ExpertKernels([lambda rows, w=w: F.linear(rows, w) for w in w13])
    k2 = ExpertKernels([lambda rows, w=w: F.linear(rows, w) for w in w2])
    try:
        got = kernel(x, k13, k2, *rest)
    except Exception as e:
        return f"raised {type(e).__name__}: {e}"
    return _close(got, native(x, w13, w2, *rest), dtype)


def _check_quant_linear(kernel_cls: Any, platform: Platform) -> list[str]:
    from llmhal.ops.quant_linear import GroupedQuantWeight, NativeQuantLinear

    gen = torch.Generator().manual_seed(0)
    n, k, group = 96, 128, 32
    device = platform.torch_device()
    out: list[str] = []
    for bits, offset in ((4, True), (4, False), (8, False)):
        if bits == 4:
            q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        else:
            q = torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8)
        scale = torch.rand(n, k // group, generator=gen) * 0.02 + 0.005
        off = -8 * scale if offset else None
        weight = GroupedQuantWeight(q, scale, off, group, bits)
        for dtype in _dtypes(platform):
            label = f"{bits}-bit{' with offset' if offset else ''}, {dtype}"
            if kernel_cls.supports(weight, dtype) is not None:
                continue  # the contract: such a weight goes to NativeQuantLinear
            x = torch.randn(5, k, generator=gen).to(device, dtype)
            try:
                y = kernel_cls(_to(weight, device), dtype)(x)
            except Exception as e:
                out.append(f"{label}: raised {type(e).__name__}: {e}")
                continue
            ref = NativeQuantLinear(weight, dtype)(x.cpu()).double()
            if y.shape != ref.shape or y.dtype != dtype:
                out.append(f"{label}: {tuple(y.shape)} {y.dtype} != {tuple(ref.shape)} {dtype}")
                continue
            rel = float((y.cpu().double() - ref).norm() / ref.norm())
            if not rel < QUANT_LINEAR_REL_ERR:
                out.append(
                    f"{label}: relative error {rel:.3g} against NativeQuantLinear "
                    f"(at most {QUANT_LINEAR_REL_ERR})"
                )
    return out


def _to(weight: Any, device: torch.device) -> Any:
    from llmhal.ops.quant_linear import GroupedQuantWeight

    off = None if weight.offset is None else weight.offset.to(device)
    return GroupedQuantWeight(
        weight.qweight.to(device), weight.scale.to(device), off, weight.group_size, weight.bits
    )


def check_op_kernel(platform: Platform, name: str) -> Finding:
    """The platform's kernel for op ``name`` against core's native op, in each supported dtype."""
    kind = "op kernel"
    kernel, bad = _load(kind, name, platform.op_kernels[name])
    if bad:
        return bad
    if name == "quant_linear":
        return Finding(kind, name, tuple(_check_quant_linear(kernel, platform)))
    if _op_inputs(name, torch.float32, torch.device("cpu"), torch.Generator()) is None:
        return Finding(kind, name, skipped=(f"the kit has no case for op {name!r} yet",))
    return Finding(kind, name, tuple(_check_function_op(name, kernel, platform)))


# ---------------------------------------------------------------------------------- quantization
def _fill(param: torch.Tensor, gen: torch.Generator) -> None:
    """Plausible stored values: small positive floats (scales stay finite), small integers."""
    with torch.no_grad():
        if param.dtype.is_floating_point:
            src = torch.rand(param.shape, generator=gen) * 0.01 + 0.001
        elif param.dtype == torch.bool:
            src = torch.zeros(param.shape, dtype=torch.bool)
        else:
            src = torch.randint(0, 16, param.shape, generator=gen)
        param.copy_(src.to(param.dtype))


def check_quantization_method(
    platform: Platform, name: str, config: Mapping[str, Any] | None = None
) -> Finding:
    """Build a tiny linear layer under method ``name`` (``config``: the checkpoint's
    ``quantization_config``; default ``{}``), fill and finish it, and run it forward."""
    from llmhal.testing.quant_layers import build_linear, finish, layer_output

    kind = "quantization method"
    cls, bad = _load(kind, name, platform.quantization_methods[name])
    if bad:
        return bad
    try:
        qconfig = cls.from_config(dict(config or {}))
    except Exception as e:
        return Finding(
            kind,
            name,
            (
                f"{cls.__name__}.from_config({dict(config or {})!r}) raised "
                f"{type(e).__name__}: {e}; give the kit an example quantization_config "
                f"(quantization_configs = {{{name!r}: {{...}}}} in a PlatformConformanceSuite "
                f"subclass, or --llmhal-quant-config {name}=JSON)",
            ),
        )
    supported = [d for d in _dtypes(platform) if d in cls.get_supported_act_dtypes()]
    if not supported:
        return Finding(kind, name, skipped=("no activation dtype shared with the platform",))
    problems = []
    device = platform.torch_device()
    for dtype in supported:
        gen = torch.Generator().manual_seed(0)
        try:
            layer = build_linear(
                qconfig, "replicated", dtype=dtype, in_features=128, out_features=64
            )
            for param in layer.parameters():
                _fill(param, gen)
            layer.to(device)
            finish(layer)
            y = layer_output(layer, torch.randn(3, 128, generator=gen).to(device, dtype))
        except Exception as e:
            problems.append(f"{dtype}: a 128->64 linear layer raised {type(e).__name__}: {e}")
            continue
        if tuple(y.shape) != (3, 64) or y.dtype != dtype:
            problems.append(f"{dtype}: output {tuple(y.shape)} {y.dtype}, expected (3, 64) {dtype}")
        elif not bool(torch.isfinite(y).all()):
            problems.append(f"{dtype}: the output holds inf or NaN")
    return Finding(kind, name, tuple(problems))


def check_behaviour(
    platform: Platform, quantization_configs: Mapping[str, Mapping[str, Any]] | None = None
) -> list[Finding]:
    """Every declared contribution of ``platform`` (a live instance), run and compared."""
    configs = quantization_configs or {}
    return [
        *(check_attention_backend(platform, n) for n in platform.attention_backends),
        *(check_op_kernel(platform, n) for n in platform.op_kernels),
        *(
            check_quantization_method(platform, n, configs.get(n))
            for n in platform.quantization_methods
        ),
    ]
