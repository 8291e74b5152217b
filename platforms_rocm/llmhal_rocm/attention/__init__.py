"""Attention backends of the ROCm platform: ``rocm_attn`` (Triton) and ``rocm_aiter_fa`` (AMD aiter).

Both keep core's shared paged layout (:mod:`llmhal.attention.paged_kv`). Importing a backend module
imports neither Triton nor aiter.
"""
