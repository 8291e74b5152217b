"""The vendor entry points the CUDA backends call, with their upstream signatures.

Transcribed from the libraries' sources (flash-attention 2.8.4 ``flash_attn/flash_attn_interface.py``
and ``hopper/flash_attn_interface.py``; FlashInfer 0.6.18 ``flashinfer/decode.py`` and
``prefill.py``, the keyword-only ``_plan_impl`` that decode's ``plan`` forwards to, and
``flashinfer/fused_moe/core.py``; FlashMLA's ``flash_mla/flash_mla_interface.py``, the 2025-02
release, whose leading positional arguments later releases keep; FBGEMM GenAI's operator schemas
in ``quantize_defs.cpp``). The test fakes bind every call to these
(:func:`llmhal.testing.signatures.bound_to`), and ``ci/gpu-check`` binds the same calls to the
installed libraries' own signatures, so a keyword renamed upstream or an argument in the wrong
position fails before a GPU runs it. Bodies are empty: only the signatures matter.
"""

from __future__ import annotations

from typing import Any

# (module, attribute path) of each entry point, for the checks against installed libraries.
ENTRY_POINTS: dict[str, tuple[str, str]] = {
    "flash_attn_varlen_func": ("flash_attn", "flash_attn_varlen_func"),
    "flash_attn_with_kvcache": ("flash_attn_interface", "flash_attn_with_kvcache"),
    "decode_wrapper_init": ("flashinfer", "BatchDecodeWithPagedKVCacheWrapper.__init__"),
    "decode_plan": ("flashinfer", "BatchDecodeWithPagedKVCacheWrapper._plan_impl"),
    "decode_run": ("flashinfer", "BatchDecodeWithPagedKVCacheWrapper.run"),
    "prefill_wrapper_init": ("flashinfer", "BatchPrefillWithPagedKVCacheWrapper.__init__"),
    "prefill_plan": ("flashinfer", "BatchPrefillWithPagedKVCacheWrapper.plan"),
    "prefill_run": ("flashinfer", "BatchPrefillWithPagedKVCacheWrapper.run"),
    "cutlass_fused_moe": ("flashinfer.fused_moe", "cutlass_fused_moe"),
    "get_mla_metadata": ("flash_mla", "get_mla_metadata"),
    "flash_mla_with_kvcache": ("flash_mla", "flash_mla_with_kvcache"),
}


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    deterministic=False, return_attn_probs=False, block_table=None,
) -> Any: ...  # fmt: skip


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
    cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
    cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
    q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
    window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
    scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0, return_softmax_lse=False,
) -> Any: ...  # fmt: skip


def decode_wrapper_init(
    self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
    paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
    paged_kv_last_page_len_buffer=None, backend="auto", jit_args=None,
) -> None: ...  # fmt: skip


def decode_plan(
    self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
    pos_encoding_mode="NONE", window_left=-1, window_right=0, logits_soft_cap=None,
    q_data_type="float16", kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None,
    rope_scale=None, rope_theta=None, non_blocking=True, block_tables=None, seq_lens=None,
    fixed_split_size=None, disable_split_kv=False, q_len_per_req=1,
) -> None: ...  # fmt: skip


def decode_run(
    self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
    return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None,
    skip_softmax_threshold_scale_factor=None, kv_cache_sf=None,
) -> Any: ...  # fmt: skip


def prefill_wrapper_init(
    self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
    paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
    custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None,
) -> None: ...  # fmt: skip


def prefill_plan(
    self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
    num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None,
    packed_custom_mask=None, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
    sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
    q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking=True,
    prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0,
    max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
    max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None,
    disable_split_kv=False,
) -> None: ...  # fmt: skip


def prefill_run(
    self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
    return_lse=False, enable_pdl=None, window_left=None, sinks=None, kv_cache_sf=None,
    skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None, uses_spcompress=None,
) -> Any: ...  # fmt: skip


def cutlass_fused_moe(
    input, token_selected_experts, token_final_scales, fc1_expert_weights, fc2_expert_weights,
    output_dtype, quant_scales, fc1_expert_biases=None, fc2_expert_biases=None, input_sf=None,
    swiglu_alpha=None, swiglu_beta=None, swiglu_limit=None, tp_size=1, tp_rank=0, ep_size=1,
    ep_rank=0, cluster_size=1, cluster_rank=0, output=None, enable_alltoall=False,
    use_deepseek_fp8_block_scale=False, use_w4_group_scaling=False, use_mxfp8_act_scaling=False,
    min_latency_mode=False, use_packed_weights=False, tune_max_num_tokens=8192, enable_pdl=None,
) -> Any: ...  # fmt: skip


def get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k) -> Any: ...


def flash_mla_with_kvcache(
    q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
    softmax_scale=None, causal=False,
) -> Any: ...  # fmt: skip


# FBGEMM GenAI operator schemas (torch.ops.fbgemm.*).
def quantize_fp8_per_row(
    input, bs=None, scale_ub=None, output_dtype=None, stochastic_rounding=False
) -> Any: ...


def f8f8bf16_rowwise(XQ, WQ, x_scale, w_scale, bias=None, use_fast_accum=True) -> Any: ...
