"""The native paged-attention kernel (``paged_attention.cpp``): built once per host, loaded with ctypes.

The kernel is plain C++ with OpenMP and no torch headers, built for the host CPU and cached by
:mod:`llmhal_cpu.native_build` (which documents ``LLMHAL_CACHE_DIR``, ``LLMHAL_CPU_KERNEL_ARCH`` and
``CXX``).

:func:`load_kernel` returns ``None`` when the kernel cannot be used (no compiler, a failed build,
``LLMHAL_CPU_ATTN_KERNEL=0``), and :func:`kernel_status` says why; ``cpu_attn`` then runs its
pure-torch paths. ``LLMHAL_CPU_ATTN_KERNEL=0`` disables the native kernel (pure torch only).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from llmhal.logger import init_logger
from llmhal_cpu import native_build, step_graph

logger = init_logger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")

# Element type codes understood by the kernel.
CACHE_TYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
}


class KernelArgs(ctypes.Structure):
    """Mirror of ``Args`` in paged_attention.cpp (checked against its ``sizeof`` on load)."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("q_s_tok", ctypes.c_int64),
        ("q_s_head", ctypes.c_int64),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("c_s_block", ctypes.c_int64),
        ("c_s_tok", ctypes.c_int64),
        ("c_s_head", ctypes.c_int64),
        ("block_table", ctypes.c_void_p),
        ("bt_s", ctypes.c_int64),
        ("seq_lens", ctypes.c_void_p),
        ("query_start_loc", ctypes.c_void_p),
        ("num_reqs", ctypes.c_int32),
        ("out", ctypes.c_void_p),
        ("o_s_tok", ctypes.c_int64),
        ("o_s_head", ctypes.c_int64),
        ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_size", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("soft_cap", ctypes.c_float),
        ("k_scale", ctypes.c_float),
        ("v_scale", ctypes.c_float),
        ("window", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
        ("min_split_tokens", ctypes.c_int32),
        ("new_k", ctypes.c_void_p),
        ("new_v", ctypes.c_void_p),
        ("nk_s_tok", ctypes.c_int64),
        ("nk_s_head", ctypes.c_int64),
        ("nv_s_tok", ctypes.c_int64),
        ("nv_s_head", ctypes.c_int64),
        ("slot_mapping", ctypes.c_void_p),
        ("num_new", ctypes.c_int64),
        ("q_bf16", ctypes.c_int32),
        ("o_bf16", ctypes.c_int32),
    ]


# Query and output dtypes the kernel reads and writes in place.
_DIRECT = (torch.float32, torch.bfloat16)


class CallArgs(ctypes.Structure):
    """Mirror of ``CallArgs`` in paged_attention.cpp: the struct form of a call (step_graph.py)."""

    _fields_ = [("args", ctypes.POINTER(KernelArgs)), ("cache_type", ctypes.c_int32)]


def _setup(lib: ctypes.CDLL) -> None:
    lib.llmhal_paged_attention_args_size.restype = ctypes.c_int64
    native_build.declare_struct_calls(
        lib,
        ("llmhal_paged_attention_call",),
        {KernelArgs: lib.llmhal_paged_attention_args_size()},
    )


def _warn_unavailable(status: str) -> None:
    logger.warning(
        "cpu_attn: native paged-attention kernel unavailable (%s); using the slower pure-torch "
        "paths",
        status,
    )


LIBRARY = native_build.KernelLibrary(
    SOURCE,
    "paged_attention",
    _setup,
    disable_env="LLMHAL_CPU_ATTN_KERNEL",
    on_unavailable=_warn_unavailable,
)


def load_kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; ``None`` when it cannot be used."""
    return LIBRARY.get()


def kernel_status() -> str:
    """``"ok"``, ``"disabled"``, ``"not built yet"`` or why the kernel is unavailable."""
    if LIBRARY.disabled():
        return "disabled by LLMHAL_CPU_ATTN_KERNEL=0"
    return LIBRARY.status or "not built yet"


def paged_attention(
    lib: ctypes.CDLL,
    *,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    out: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    soft_cap: float | None,
    k_scale: float,
    v_scale: float,
    window: int | None,
    min_split_tokens: int,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One kernel call: store ``new_kv`` if given, then attend for the first ``num_reqs`` requests.

    ``query``/``out`` are [tokens, num_heads, head_size], the first token of request 0 at row 0
    (rows of the first ``num_reqs`` requests are used); ``k_cache``/``v_cache`` are [num_blocks,
    block_size, num_kv_heads, head_size] with a contiguous last dimension;
    ``block_table``/``seq_lens``/``query_start_loc`` are contiguous int32 tensors as in
    ``CommonAttentionMetadata``. ``new_kv`` is (key, value, slot_mapping): [T, num_kv_heads,
    head_size] tensors in the cache's dtype with a contiguous last dimension, and int64 slots
    (-1: padding, skipped). Any query/output dtype; the kernel itself computes in fp32, and reads
    and writes float32 and bfloat16 rows where they are (a bf16 step then makes no torch call
    here, so it can be recorded as a step graph); other dtypes go through float32 copies.
    """
    q = query
    if q.dtype not in _DIRECT or q.stride(-1) != 1:
        q = q.to(torch.float32).contiguous()
    o = (
        out
        if out.dtype in _DIRECT and out.stride(-1) == 1
        else torch.empty_like(q, dtype=torch.float32)
    )
    args = KernelArgs(
        q=q.data_ptr(),
        q_s_tok=q.stride(0),
        q_s_head=q.stride(1),
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        c_s_block=k_cache.stride(0),
        c_s_tok=k_cache.stride(1),
        c_s_head=k_cache.stride(2),
        block_table=block_table.data_ptr(),
        bt_s=block_table.stride(0),
        seq_lens=seq_lens.data_ptr(),
        query_start_loc=query_start_loc.data_ptr(),
        num_reqs=num_reqs,
        out=o.data_ptr(),
        o_s_tok=o.stride(0),
        o_s_head=o.stride(1),
        num_heads=q.shape[1],
        num_kv_heads=num_kv_heads,
        head_size=q.shape[2],
        block_size=k_cache.shape[1],
        scale=scale,
        soft_cap=soft_cap or 0.0,
        k_scale=k_scale,
        v_scale=v_scale,
        window=window or 0,
        num_threads=torch.get_num_threads(),
        min_split_tokens=min_split_tokens,
        q_bf16=int(q.dtype == torch.bfloat16),
        o_bf16=int(o.dtype == torch.bfloat16),
    )
    if new_kv is not None:
        key, value, slots = new_kv
        args.new_k, args.new_v = key.data_ptr(), value.data_ptr()
        args.nk_s_tok, args.nk_s_head = key.stride(0), key.stride(1)
        args.nv_s_tok, args.nv_s_head = value.stride(0), value.stride(1)
        args.slot_mapping, args.num_new = slots.data_ptr(), slots.shape[0]
    # ctypes.pointer keeps `args` alive as long as `call` (a recorded step holds `call`).
    call = CallArgs(ctypes.pointer(args), CACHE_TYPE_CODES[k_cache.dtype])
    if step_graph.launch(lib.llmhal_paged_attention_call, call) != 0:
        raise RuntimeError(f"the paged-attention kernel does not take cache dtype {k_cache.dtype}")
    if num_reqs and o is not out:
        out.copy_(o)
