"""CPU kernels of the state-space ops (signatures in :mod:`llmhal.ops.mamba_ops`, Mamba-2's gated
RMSNorm included) and of lightning attention's decode step (:mod:`llmhal.ops.linear_attn_ops`).

Calls whose tensors the native kernels read (``kernels/mamba_ops.cpp``) run there: activations
(x, dt, B, C, z; for the conv also its weights and state) all float32 or all bfloat16, the SSM
state (and lightning attention's) float32 or bfloat16 whatever the activations are
(``mamba_ssm_cache_dtype``), A float32, D and dt_bias either; any strides, but each state row and each B/C row
contiguous along its last dimension. One call per op, states updated in place, no host read of the
slot indices or ``query_start_loc``, so a decode step made of these calls can be recorded and
replayed by :mod:`llmhal_cpu.step_graph`. Anything else (float16, a layout the kernel does not
read, a host without a compiler, ``LLMHAL_CPU_MAMBA_KERNEL=0``) runs core's reference, which also
raises the errors (a slot index out of range makes the kernel return before writing, and the
reference then says which).

Numerics: float32 arithmetic whatever the activation dtype, like the reference; bfloat16 results
round to nearest even as torch's cast does. A bfloat16 state is widened to float32, updated and
rounded back once per call (a prefill runs all its tokens on the float32 copy, as the reference
does), so the output is computed from the unrounded state. The kernels run the recurrence token by token, which
is what the reference's chunked SSD computes up to rounding; the decay of Mamba-1 and the SiLUs
use a 1-ulp vector exp (``simd_math.h``).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from llmhal.ops import mamba_ops as ref
from llmhal_cpu import native_build, step_graph

SOURCE = Path(__file__).with_name("kernels") / "mamba_ops.cpp"
_F32 = torch.float32
_p, _i64, _i32, _f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
# The conv kernel keeps a block's state rows on the stack (kernels/mamba_ops.cpp).
MAX_CONV_WIDTH = 9


class ConvArgs(ctypes.Structure):  # mirrors kernels/mamba_ops.cpp
    _fields_ = [
        ("x", _p), ("x_s", _i64), ("out", _p), ("states", _p), ("st_slot", _i64),
        ("st_row", _i64), ("w", _p), ("w_sd", _i64), ("w_sk", _i64), ("bias", _p), ("qsl", _p),
        ("idx", _p), ("has_init", _p), ("nseq", _i64), ("tokens", _i64), ("dim", _i64),
        ("width", _i64), ("slots", _i64), ("silu", _i32), ("bf16", _i32), ("threads", _i32),
    ]  # fmt: skip


class SsmUpdateArgs(ctypes.Structure):
    _fields_ = [
        ("states", _p), ("st_slot", _i64), ("st_h", _i64), ("st_p", _i64),
        ("x", _p), ("x_b", _i64), ("x_h", _i64), ("x_p", _i64),
        ("dt", _p), ("dt_b", _i64), ("dt_h", _i64), ("dt_p", _i64),
        ("A", _p), ("A_h", _i64), ("A_p", _i64), ("A_n", _i64),
        ("B", _p), ("B_b", _i64), ("B_g", _i64), ("C", _p), ("C_b", _i64), ("C_g", _i64),
        ("D", _p), ("D_h", _i64), ("D_p", _i64), ("z", _p), ("z_b", _i64), ("z_h", _i64),
        ("z_p", _i64), ("dt_bias", _p), ("db_h", _i64), ("db_p", _i64), ("idx", _p),
        ("out", _p), ("nb", _i64), ("H", _i64), ("P", _i64), ("N", _i64), ("G", _i64),
        ("slots", _i64), ("softplus", _i32), ("bf16", _i32), ("D_bf16", _i32),
        ("db_bf16", _i32), ("threads", _i32), ("st_bf16", _i32),
    ]  # fmt: skip


class ScanArgs(ctypes.Structure):
    _fields_ = [
        ("x", _p), ("x_t", _i64), ("x_d", _i64), ("dt", _p), ("dt_t", _i64), ("dt_d", _i64),
        ("A", _p), ("A_d", _i64), ("A_n", _i64), ("B", _p), ("B_t", _i64), ("C", _p),
        ("C_t", _i64), ("D", _p), ("D_s", _i64), ("z", _p), ("z_t", _i64), ("z_d", _i64),
        ("dt_bias", _p), ("db_s", _i64), ("states", _p), ("st_slot", _i64), ("st_d", _i64),
        ("qsl", _p), ("idx", _p), ("has_init", _p), ("out", _p), ("nseq", _i64),
        ("tokens", _i64), ("d", _i64), ("n", _i64), ("slots", _i64), ("softplus", _i32),
        ("bf16", _i32), ("D_bf16", _i32), ("db_bf16", _i32), ("threads", _i32),
        ("st_bf16", _i32),
    ]  # fmt: skip


class SsdArgs(ctypes.Structure):
    _fields_ = [
        ("x", _p), ("x_t", _i64), ("x_h", _i64), ("x_p", _i64), ("dt", _p), ("dt_t", _i64),
        ("dt_h", _i64), ("A", _p), ("A_s", _i64), ("B", _p), ("B_t", _i64), ("B_g", _i64),
        ("C", _p), ("C_t", _i64), ("C_g", _i64), ("D", _p), ("D_s", _i64), ("dt_bias", _p),
        ("db_s", _i64), ("states", _p), ("st_slot", _i64), ("st_h", _i64), ("st_p", _i64),
        ("qsl", _p), ("idx", _p), ("has_init", _p), ("out", _p), ("nseq", _i64),
        ("tokens", _i64), ("H", _i64), ("P", _i64), ("N", _i64), ("G", _i64), ("slots", _i64),
        ("dt_lo", _f), ("dt_hi", _f), ("softplus", _i32), ("bf16", _i32), ("D_bf16", _i32),
        ("db_bf16", _i32), ("threads", _i32), ("st_bf16", _i32),
    ]  # fmt: skip


class LightningDecodeArgs(ctypes.Structure):
    _fields_ = [
        ("q", _p), ("q_b", _i64), ("q_h", _i64), ("k", _p), ("k_b", _i64), ("k_h", _i64),
        ("v", _p), ("v_b", _i64), ("v_h", _i64), ("factor", _p), ("states", _p),
        ("st_slot", _i64), ("st_h", _i64), ("st_d", _i64), ("idx", _p), ("out", _p),
        ("nb", _i64), ("H", _i64), ("D", _i64), ("Dv", _i64), ("slots", _i64), ("bf16", _i32),
        ("threads", _i32), ("st_bf16", _i32),
    ]  # fmt: skip


class GatedNormArgs(ctypes.Structure):
    _fields_ = [
        ("x", _p), ("x_s", _i64), ("z", _p), ("z_s", _i64), ("w", _p), ("out", _p), ("t", _i64),
        ("d", _i64), ("group", _i64), ("eps", _f), ("bf16", _i32), ("threads", _i32),
    ]  # fmt: skip


# llmhal_mamba_ops_args_size's order
_STRUCTS = (ConvArgs, SsmUpdateArgs, ScanArgs, SsdArgs, LightningDecodeArgs, GatedNormArgs)


def _setup(lib: ctypes.CDLL) -> None:
    lib.llmhal_mamba_ops_args_size.argtypes = [ctypes.c_int]
    lib.llmhal_mamba_ops_args_size.restype = ctypes.c_int64
    native_build.declare_struct_calls(
        lib,
        (
            "llmhal_conv_call",
            "llmhal_ssm_update_call",
            "llmhal_scan_call",
            "llmhal_ssd_call",
            "llmhal_lightning_decode_call",
            "llmhal_gated_norm_call",
        ),
        {s: lib.llmhal_mamba_ops_args_size(i) for i, s in enumerate(_STRUCTS)},
    )


LIBRARY = native_build.KernelLibrary(
    SOURCE, "mamba_ops", _setup, disable_env="LLMHAL_CPU_MAMBA_KERNEL"
)


def _lib() -> ctypes.CDLL | None:
    return LIBRARY.lib if LIBRARY.status is not None else LIBRARY.get()


def status() -> str:
    """Which path runs (for ``llmhal doctor``)."""
    if LIBRARY.disabled():
        return "torch reference (LLMHAL_CPU_MAMBA_KERNEL=0)"
    lib = LIBRARY.get()
    return (
        "native mamba_ops (float32 and bfloat16; core's reference for other dtypes)"
        if lib
        else f"torch reference ({LIBRARY.status})"
    )


_ACT_DTYPES = (torch.float32, torch.bfloat16)
MAX_STATE_SIZE = 1024  # the kernels convert a B/C row of up to this many elements on the stack
MAX_NORM_GROUP = 16384  # the gated norm holds a group of up to this many channels on the stack


def _same(dtype: torch.dtype, *ts: torch.Tensor | None) -> bool:
    """Every given tensor of ``dtype``, in host memory (None: an absent optional argument)."""
    return all(t is None or (t.dtype == dtype and t.is_cpu) for t in ts)


def _acts(x: torch.Tensor, *ts: torch.Tensor | None) -> bool:
    """``x`` float32 or bfloat16 and the other activations of its dtype."""
    return x.dtype in _ACT_DTYPES and _same(x.dtype, x, *ts)


def _param_ok(*ts: torch.Tensor | None) -> bool:
    """Per-channel parameters (D, dt_bias): float32 or bfloat16 each, in host memory."""
    return all(t is None or (t.dtype in _ACT_DTYPES and t.is_cpu) for t in ts)


def _state_ok(states: torch.Tensor) -> bool:
    """A recurrent state the kernels read and write: float32 or bfloat16 (mamba_ssm_cache_dtype),
    in host memory, whatever the activations' dtype."""
    return states.dtype in _ACT_DTYPES and states.is_cpu


def _bf16(t: torch.Tensor | None) -> int:
    return int(t is not None and t.dtype == torch.bfloat16)


def _rows(*ts: torch.Tensor) -> bool:
    """Every tensor's last dimension contiguous (or of size 1)."""
    return all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in ts)


def _index(t: torch.Tensor, n: int, dtype: torch.dtype = torch.int32) -> bool:
    return t.dtype == dtype and t.is_cpu and t.is_contiguous() and t.numel() == n


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _st(t: torch.Tensor | None, dim: int) -> int:
    return 0 if t is None else t.stride(dim)


def _run(fn_name: str, args: ctypes.Structure) -> bool:
    lib = _lib()
    assert lib is not None
    return step_graph.launch(getattr(lib, fn_name), args) == 0


def _conv_ok(x, weight, bias, conv_states, activation) -> bool:
    if _lib() is None or not _acts(x, weight, bias, conv_states):
        return False
    if activation not in (None, *ref.CONV_ACTIVATIONS):
        return False  # the reference names the remedy
    dim, width = weight.shape
    return (
        x.dim() == 2
        and x.shape[1] == dim
        and 2 <= width <= MAX_CONV_WIDTH
        and conv_states.dim() == 3
        and tuple(conv_states.shape[1:]) == (width - 1, dim)
        and (bias is None or (bias.is_contiguous() and bias.numel() == dim))
        and _rows(x, conv_states)
    )


def _conv_args(x, weight, bias, conv_states, out, qsl, idx, has_init, nseq, activation):
    return ConvArgs(
        x=x.data_ptr(), x_s=x.stride(0), out=out.data_ptr(), states=conv_states.data_ptr(),
        st_slot=conv_states.stride(0), st_row=conv_states.stride(1), w=weight.data_ptr(),
        w_sd=weight.stride(0), w_sk=weight.stride(1), bias=_ptr(bias), qsl=_ptr(qsl),
        idx=idx.data_ptr(), has_init=_ptr(has_init), nseq=nseq, tokens=x.shape[0],
        dim=x.shape[1], width=weight.shape[1], slots=conv_states.shape[0],
        silu=int(activation is not None), bf16=_bf16(x), threads=torch.get_num_threads(),
    )  # fmt: skip


def causal_conv1d_fn(
    x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation
):
    nseq = cache_indices.numel()
    if (
        _conv_ok(x, weight, bias, conv_states, activation)
        and _index(query_start_loc, nseq + 1)
        and _index(cache_indices, nseq)
        and _index(has_initial_state, nseq, torch.bool)
    ):
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu")
        args = _conv_args(
            x, weight, bias, conv_states, out, query_start_loc, cache_indices,
            has_initial_state, nseq, activation,
        )  # fmt: skip
        if _run("llmhal_conv_call", args):
            return out
    return ref.causal_conv1d_fn(
        x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation
    )


def causal_conv1d_update(x, conv_states, weight, bias, activation, cache_indices):
    nseq = x.shape[0] if x.dim() == 2 else -1
    if _conv_ok(x, weight, bias, conv_states, activation) and _index(cache_indices, nseq):
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu")
        args = _conv_args(
            x, weight, bias, conv_states, out, None, cache_indices, None, nseq, activation
        )
        if _run("llmhal_conv_call", args):
            return out
    return ref.causal_conv1d_update(x, conv_states, weight, bias, activation, cache_indices)


def selective_state_update(
    ssm_states, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_indices
):  # fmt: skip
    usable = (
        _lib() is not None
        and _acts(x, dt, B, C, z)
        and _state_ok(ssm_states)
        and _same(_F32, A)
        and _param_ok(D, dt_bias)
        and x.dim() == 3
        and ssm_states.dim() == 4
        and B.dim() == 3
    )
    if usable:
        nb, heads, hp = x.shape
        n, groups = ssm_states.shape[3], B.shape[1]
        usable = (
            tuple(ssm_states.shape[1:]) == (heads, hp, n)
            and dt.shape == x.shape
            and (z is None or z.shape == x.shape)
            and tuple(A.shape) == (heads, hp, n)
            and tuple(B.shape) == (nb, groups, n) == tuple(C.shape)
            and all(t is None or tuple(t.shape) == (heads, hp) for t in (D, dt_bias))
            and groups > 0
            and heads % groups == 0
            and n <= MAX_STATE_SIZE
            and _rows(ssm_states, B, C)
            and _index(state_indices, nb)
        )
    if usable:
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu")
        args = SsmUpdateArgs(
            ssm_states.data_ptr(), *ssm_states.stride()[:3],
            x.data_ptr(), *x.stride(), dt.data_ptr(), *dt.stride(), A.data_ptr(), *A.stride(),
            B.data_ptr(), B.stride(0), B.stride(1), C.data_ptr(), C.stride(0), C.stride(1),
            _ptr(D), _st(D, 0), _st(D, 1), _ptr(z), _st(z, 0), _st(z, 1), _st(z, 2),
            _ptr(dt_bias), _st(dt_bias, 0), _st(dt_bias, 1), state_indices.data_ptr(),
            out.data_ptr(), nb, heads, hp, n, groups, ssm_states.shape[0], int(dt_softplus),
            _bf16(x), _bf16(D), _bf16(dt_bias), torch.get_num_threads(), _bf16(ssm_states),
        )  # fmt: skip
        if _run("llmhal_ssm_update_call", args):
            return out
    return ref.selective_state_update(
        ssm_states, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_indices
    )


def _varlen_ok(query_start_loc, cache_indices, has_initial_state) -> bool:
    nseq = cache_indices.numel()
    return (
        _index(query_start_loc, nseq + 1)
        and _index(cache_indices, nseq)
        and _index(has_initial_state, nseq, torch.bool)
    )


def selective_scan_varlen(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, ssm_states, query_start_loc, cache_indices,
    has_initial_state,
):  # fmt: skip
    usable = (
        _lib() is not None
        and _acts(x, dt, B, C, z)
        and _state_ok(ssm_states)
        and _same(_F32, A)
        and _param_ok(D, dt_bias)
        and x.dim() == 2
        and ssm_states.dim() == 3
        and _varlen_ok(query_start_loc, cache_indices, has_initial_state)
    )
    if usable:
        t, d = x.shape
        n = ssm_states.shape[2]
        usable = (
            ssm_states.shape[1] == d
            and dt.shape == x.shape
            and (z is None or z.shape == x.shape)
            and tuple(A.shape) == (d, n)
            and tuple(B.shape) == (t, n) == tuple(C.shape)
            and all(v is None or tuple(v.shape) == (d,) for v in (D, dt_bias))
            and n <= MAX_STATE_SIZE
            and _rows(ssm_states, B, C)
        )
    if usable:
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu")
        args = ScanArgs(
            x.data_ptr(), *x.stride(), dt.data_ptr(), *dt.stride(), A.data_ptr(), *A.stride(),
            B.data_ptr(), B.stride(0), C.data_ptr(), C.stride(0), _ptr(D), _st(D, 0), _ptr(z),
            _st(z, 0), _st(z, 1), _ptr(dt_bias), _st(dt_bias, 0), ssm_states.data_ptr(),
            ssm_states.stride(0), ssm_states.stride(1), query_start_loc.data_ptr(),
            cache_indices.data_ptr(), has_initial_state.data_ptr(), out.data_ptr(),
            cache_indices.numel(), t, d, n, ssm_states.shape[0], int(dt_softplus), _bf16(x),
            _bf16(D), _bf16(dt_bias), torch.get_num_threads(), _bf16(ssm_states),
        )  # fmt: skip
        if _run("llmhal_scan_call", args):
            return out
    return ref.selective_scan_varlen(
        x, dt, A, B, C, D, z, dt_bias, dt_softplus, ssm_states, query_start_loc, cache_indices,
        has_initial_state,
    )  # fmt: skip


def ssd_chunk_scan_varlen(
    x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit, ssm_states, query_start_loc,
    cache_indices, has_initial_state,
):  # fmt: skip
    usable = (
        _lib() is not None
        and chunk_size >= 1
        and _acts(x, dt, B, C)
        and _state_ok(ssm_states)
        and _same(_F32, A)
        and _param_ok(D, dt_bias)
        and x.dim() == 3
        and B.dim() == 3
        and ssm_states.dim() == 4
        and _varlen_ok(query_start_loc, cache_indices, has_initial_state)
    )
    if usable:
        t, heads, hp = x.shape
        n, groups = ssm_states.shape[3], B.shape[1]
        usable = (
            tuple(ssm_states.shape[1:]) == (heads, hp, n)
            and tuple(dt.shape) == (t, heads)
            and tuple(A.shape) == (heads,)
            and tuple(B.shape) == (t, groups, n) == tuple(C.shape)
            and all(v is None or tuple(v.shape) == (heads,) for v in (D, dt_bias))
            and groups > 0
            and heads % groups == 0
            and n <= MAX_STATE_SIZE
            and _rows(ssm_states, B, C)
        )
    if usable:
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu")
        lo, hi = (float("-inf"), float("inf")) if dt_limit is None else dt_limit
        args = SsdArgs(
            x.data_ptr(), *x.stride(), dt.data_ptr(), *dt.stride(), A.data_ptr(), A.stride(0),
            B.data_ptr(), B.stride(0), B.stride(1), C.data_ptr(), C.stride(0), C.stride(1),
            _ptr(D), _st(D, 0), _ptr(dt_bias), _st(dt_bias, 0), ssm_states.data_ptr(),
            *ssm_states.stride()[:3], query_start_loc.data_ptr(), cache_indices.data_ptr(),
            has_initial_state.data_ptr(), out.data_ptr(), cache_indices.numel(), t, heads, hp,
            n, groups, ssm_states.shape[0], lo, hi, int(dt_softplus), _bf16(x), _bf16(D),
            _bf16(dt_bias), torch.get_num_threads(), _bf16(ssm_states),
        )  # fmt: skip
        if _run("llmhal_ssd_call", args):
            return out
    return ref.ssd_chunk_scan_varlen(
        x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit, ssm_states,
        query_start_loc, cache_indices, has_initial_state,
    )  # fmt: skip


def gated_rms_norm(x, gate, weight, group_size, eps):
    """Mamba-2's gated RMSNorm (signature in :mod:`llmhal.ops.mamba_ops`): one native call with
    x, gate and weight all float32 or all bfloat16, rows contiguous along the channels."""
    usable = (
        _lib() is not None
        and x.dim() == 2
        and _acts(x, gate, weight)
        and (gate is None or gate.shape == x.shape)
        and weight.is_contiguous()
        and weight.numel() == x.shape[1]
        and 1 <= group_size <= MAX_NORM_GROUP
        and x.shape[1] % group_size == 0
        and _rows(x, *(() if gate is None else (gate,)))
    )
    if usable:
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu")
        args = GatedNormArgs(
            x.data_ptr(), x.stride(0), _ptr(gate), _st(gate, 0), weight.data_ptr(),
            out.data_ptr(), x.shape[0], x.shape[1], group_size, eps, _bf16(x),
            torch.get_num_threads(),
        )  # fmt: skip
        if _run("llmhal_gated_norm_call", args):
            return out
    return ref.gated_rms_norm(x, gate, weight, group_size, eps)


def lightning_attn_decode(q, k, v, decay, kv_states, cache_indices):
    """MiniMax's linear-attention decode step (signature in :mod:`llmhal.ops.linear_attn_ops`):
    each state advanced where it lies, in one native call."""
    usable = (
        _lib() is not None
        and q.dim() == 3
        and _acts(q, k, v)
        and _state_ok(kv_states)
        and k.shape == q.shape
        and v.shape[:2] == q.shape[:2]
        and kv_states.dim() == 4
        and tuple(kv_states.shape[1:]) == (q.shape[1], q.shape[2], v.shape[2])
        and v.shape[2] <= MAX_STATE_SIZE
        and decay.numel() == q.shape[1]
        and _rows(q, k, v, kv_states)
        and _index(cache_indices, q.shape[0])
    )
    if usable:
        factor = torch.exp(-decay.to(device="cpu", dtype=_F32)).contiguous()
        out = torch.empty(v.shape, dtype=q.dtype, device="cpu")
        nb, heads, d = q.shape
        args = LightningDecodeArgs(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1), factor.data_ptr(), kv_states.data_ptr(),
            *kv_states.stride()[:3], cache_indices.data_ptr(), out.data_ptr(), nb, heads, d,
            v.shape[2], kv_states.shape[0], _bf16(q), torch.get_num_threads(), _bf16(kv_states),
        )  # fmt: skip
        if _run("llmhal_lightning_decode_call", args):
            return out
    from llmhal.ops import linear_attn_ops

    return linear_attn_ops.lightning_attn_decode(q, k, v, decay, kv_states, cache_indices)


for _fn in (
    gated_rms_norm,
    lightning_attn_decode,
    causal_conv1d_fn,
    causal_conv1d_update,
    selective_state_update,
    selective_scan_varlen,
    ssd_chunk_scan_varlen,
):
    _fn.status = status  # type: ignore[attr-defined]  # shown by llmhal doctor
