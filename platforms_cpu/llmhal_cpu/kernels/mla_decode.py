"""The native MLA decode kernel (``mla_decode.cpp``): loading and the call.

:func:`mla_decode` does a step's MLA work for the ``cpu_mla`` backend in one native call: it stores
the step's new latents, and for the rows of its leading short requests (decodes, draft
verifications, short prompt chunks) absorbs the queries through ``W_UK``,
attends over the paged latent cache and applies ``W_UV``. It goes through
:func:`llmhal_cpu.step_graph.launch` and reads the step (slots, block table, sequence lengths) from
the tensors it is given, so a step calling it can be recorded and replayed. It returns False
(nothing done) when the call is not one the kernel takes (a dtype or cache format it does not read,
a layout it does not address, the library unavailable); the backend then runs ``torch_mla``'s ops.
Built on first use by :mod:`llmhal_cpu.native_build`; ``LLMHAL_CPU_MLA_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from llmhal.attention.mla.common import MLADims
from llmhal_cpu import native_build, step_graph

SOURCE = Path(__file__).with_name("mla_decode.cpp")
DTYPES = (torch.float32, torch.bfloat16)

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class MlaDecodeArgs(ctypes.Structure):  # mirrors mla_decode.cpp
    _fields_ = [
        ("q", _p), ("q_s", _i64), ("q_hs", _i64), ("kv_c", _p), ("c_s", _i64), ("k_pe", _p),
        ("pe_s", _i64), ("cache", _p), ("num_slots", _i64), ("slots", _p),
        ("query_start_loc", _p), ("block_table", _p), ("bt_s", _i64), ("seq_lens", _p),
        ("w_uk", _p), ("w_uv", _p), ("w_uk_pairs", _p), ("w_uv_pairs", _p), ("out", _p),
        ("t", _i64), ("reqs", _i64), ("q_rows", _i64), ("out_rows", _i64), ("scale", _f32),
        ("heads", _i32), ("nope", _i32), ("rope", _i32), ("v", _i32), ("lora", _i32),
        ("block_size", _i32), ("threads", _i32), ("bf16", _i32),
    ]  # fmt: skip


def _setup(lib: ctypes.CDLL) -> None:
    lib.llmhal_mla_decode_args_size.restype = ctypes.c_int64
    lib.llmhal_mla_decode_bf16_dots.restype = ctypes.c_int32
    lib.llmhal_mla_pack_pairs.restype = None
    lib.llmhal_mla_pack_pairs.argtypes = [_p, *[_i64] * 6, _p]
    native_build.declare_struct_calls(
        lib, ("llmhal_mla_decode_call",), {MlaDecodeArgs: lib.llmhal_mla_decode_args_size()}
    )


LIBRARY = native_build.KernelLibrary(
    SOURCE, "mla_decode", _setup, disable_env="LLMHAL_CPU_MLA_KERNEL"
)

_ERRORS = {
    -1: "a slot in slot_mapping is outside the latent cache",
    -2: "a sequence length is outside (its query rows)..(block table width x block size)",
    -3: "a block id in the block table is outside the latent cache",
    -4: "query_start_loc does not start at 0, decrease nowhere and stay within the step's tokens",
    -5: "query_start_loc[num_reqs] (the query rows) is more than the rows of the query or of out",
}


def status() -> str:
    """``"native"`` or why ``torch_mla``'s ops run (for ``llmhal doctor``)."""
    if LIBRARY.disabled():
        return "torch (LLMHAL_CPU_MLA_KERNEL=0)"
    lib = LIBRARY.get()
    return "native mla_decode (float32, bfloat16)" if lib else f"torch ({LIBRARY.status})"


def _rows(x: torch.Tensor, dim: int, dtype: torch.dtype) -> bool:
    """Host memory of ``dtype`` with ``dim`` dimensions and contiguous innermost rows."""
    return x.dtype == dtype and x.dim() == dim and x.stride(-1) == 1 and x.is_cpu


def takes(
    query: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor
) -> bool:
    """Whether :func:`mla_decode` runs these (a cheap check: dtypes and layouts only)."""
    dt = query.dtype
    if dt not in DTYPES or kv_cache.dtype != dt or not kv_cache.is_contiguous():
        return False
    if not (_rows(query, 3, dt) and _rows(kv_c, 2, dt) and _rows(k_pe, 2, dt)):
        return False
    return LIBRARY.get() is not None


class _Pairs:
    """A weight packed by ``llmhal_mla_pack_pairs``, for the memory it was packed from."""

    def __init__(self, lib: ctypes.CDLL, w: torch.Tensor, k_dim: int) -> None:
        heads, k, n = w.shape[0], w.shape[k_dim], w.shape[3 - k_dim]
        self.key = w.data_ptr()
        # ctypes memory, not a torch tensor: this runs on a step's first call, possibly while a
        # step graph is captured, where torch would lend its allocation from the graph's pool and
        # refuse the capture for the packing.
        self.buf = (ctypes.c_uint32 * (heads * ((k + 1) // 2) * n))()
        lib.llmhal_mla_pack_pairs(
            w.data_ptr(), heads, w.stride(0), k, w.stride(k_dim), n, w.stride(3 - k_dim),
            ctypes.addressof(self.buf),
        )  # fmt: skip

    @property
    def address(self) -> int:
        return ctypes.addressof(self.buf)


def _packed(lib: ctypes.CDLL, w: torch.Tensor, k_dim: int) -> int:
    """The address of ``w`` packed in pairs along dimension ``k_dim`` (1: W_UK's nope rows, 2:
    W_UV's latent columns), packed on first use and kept on the tensor: ``mla_weights`` returns the
    same tensors until the layer's weights change (then new ones; nothing writes them in place,
    and inference tensors keep no version to check), so that is once per layer (the same bytes as
    the weight again). Packing reads values with no torch call, so it may run while a step graph
    is captured; the replays then read the same packed memory."""
    got = getattr(w, "_llmhal_mla_pairs", None)
    if got is None or got.key != w.data_ptr():
        got = _Pairs(lib, w, k_dim)
        w._llmhal_mla_pairs = got  # type: ignore[attr-defined]
    return got.address


def _shapes_fit(
    dims: MLADims,
    query: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
) -> bool:
    d = dims
    return (
        query.shape[1:] == (d.num_heads, d.qk_head_dim)
        and kv_c.shape[1] == d.kv_lora_rank
        and k_pe.shape[1] == d.qk_rope_head_dim
        and kv_cache.dim() == 3
        and kv_cache.shape[2] == d.latent_size
    )


def mla_decode(
    dims: MLADims,
    scale: float,
    query: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    num_rows: int,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    out: torch.Tensor,
) -> bool:
    """Store the latents of ``slots``' tokens and write the query rows of the first ``num_reqs``
    requests (``num_rows`` = ``query_start_loc[num_reqs]`` of them) into ``out``.

    ``query`` [T, H, nope + rope] (``q_pe`` rotated), ``kv_c`` [T, L], ``k_pe`` [T, rope], the
    latent cache [blocks, block_size, L + rope], all of one dtype (float32 or bfloat16); ``slots``
    int64 [T] (-1: not written); ``query_start_loc`` int32 [>= num_reqs + 1], ``block_table``
    int32 [>= num_reqs, width] and ``seq_lens`` int32 [>= num_reqs] (the step's requests in
    order: these are its leading ones); ``w_uk`` [H, nope, L] / ``w_uv`` [H, v, L]; ``out``
    contiguous [>= num_rows, H, v] in the query's dtype. Each row attends causally to its
    request's tokens up to its own position. False: nothing was done (see the module docstring).
    IndexError: an index tensor points outside what it indexes, checked by the kernel before
    anything is written (the query and out rows against ``query_start_loc[num_reqs]`` too, which
    a recorded step reads anew at each replay, unlike ``num_rows``).
    """
    d = dims
    if not (takes(query, kv_c, k_pe, kv_cache) and _shapes_fit(d, query, kv_c, k_pe, kv_cache)):
        return False
    lib = LIBRARY.lib
    dt = query.dtype
    t = slots.shape[0]
    if (
        slots.dtype != torch.int64
        or not slots.is_contiguous()
        or min(kv_c.shape[0], k_pe.shape[0]) < t
    ):
        return False
    if block_table.dtype != torch.int32 or not block_table.is_contiguous():
        return False
    for index in (seq_lens, query_start_loc):
        if index.dtype != torch.int32 or not index.is_contiguous():
            return False
    for w, rows in ((w_uk, d.qk_nope_head_dim), (w_uv, d.v_head_dim)):
        if w.dtype != dt or not w.is_contiguous() or w.shape != (d.num_heads, rows, d.kv_lora_rank):
            return False
    if out.dtype != dt or not out.is_contiguous() or out.shape[1:] != (d.num_heads, d.v_head_dim):
        return False
    if min(query.shape[0], out.shape[0]) < num_rows or query_start_loc.shape[0] <= num_reqs:
        return False
    if min(block_table.shape[0], seq_lens.shape[0]) < num_reqs:
        return False
    block_size = kv_cache.shape[1]
    # With AVX512-BF16, a bf16 call's W_UK and W_UV products run on bf16 dots over the weights
    # packed in pairs (mla_decode.cpp); elsewhere the kernel reads w_uk / w_uv as they are.
    uk_pairs = uv_pairs = 0
    if dt == torch.bfloat16 and lib.llmhal_mla_decode_bf16_dots():
        uk_pairs, uv_pairs = _packed(lib, w_uk, 1), _packed(lib, w_uv, 2)
    args = MlaDecodeArgs(
        q=query.data_ptr(), q_s=query.stride(0), q_hs=query.stride(1),
        kv_c=kv_c.data_ptr(), c_s=kv_c.stride(0), k_pe=k_pe.data_ptr(), pe_s=k_pe.stride(0),
        cache=kv_cache.data_ptr(), num_slots=kv_cache.shape[0] * block_size,
        slots=slots.data_ptr(), query_start_loc=query_start_loc.data_ptr(),
        block_table=block_table.data_ptr(), bt_s=block_table.stride(0),
        seq_lens=seq_lens.data_ptr(), w_uk=w_uk.data_ptr(), w_uv=w_uv.data_ptr(),
        w_uk_pairs=uk_pairs, w_uv_pairs=uv_pairs,
        out=out.data_ptr(), t=t, reqs=num_reqs, q_rows=query.shape[0], out_rows=out.shape[0],
        scale=scale, heads=d.num_heads, nope=d.qk_nope_head_dim, rope=d.qk_rope_head_dim, v=d.v_head_dim, lora=d.kv_lora_rank,
        block_size=block_size, threads=torch.get_num_threads(), bf16=int(dt == torch.bfloat16),
    )  # fmt: skip
    rc = step_graph.launch(lib.llmhal_mla_decode_call, args)
    if rc != 0:
        raise IndexError(f"mla_decode: {_ERRORS.get(rc, f'error {rc}')}")
    return True
