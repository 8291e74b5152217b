"""Attention backends of the CUDA platform: ``flash_attn`` and ``flashinfer``.

Both keep core's shared paged layout (:mod:`llmhal.attention.paged_kv`):
``[2, num_blocks, block_size, num_kv_heads, head_size]``, so ``kv_cache[0]``/``kv_cache[1]`` are the
``[num_blocks, block_size, num_kv_heads, head_size]`` page arrays both libraries read. Importing a
backend module imports neither library; they load on the first forward.
"""
