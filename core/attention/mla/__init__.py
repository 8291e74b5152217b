"""Multi-head Latent Attention (DeepSeek-V2/V3): the MLA contract and its core backends.

* ``common.py``: the contract. :class:`~llmhal.attention.mla.common.MLAAttention` is the layer a
  model uses (an :class:`~llmhal.attention.layer.Attention` of kind ``mla``, so the engine allocates
  and binds its cache like any other); the latent cache layout (one "head" of ``kv_lora_rank +
  qk_rope_head_dim`` values per token); the weight absorption every MLA backend shares.
* ``reference.py``: ``reference_mla``, pure torch in float32, a loop over requests; it defines the
  semantics the other MLA backends are tested against.
* ``torch_mla.py``: ``torch_mla``, the same math batched (every decode at once, prefills through
  ``scaled_dot_product_attention``), in the model dtype: the one a CPU picks.

Both are selected by kind: an MLA layer gets an MLA backend, and an explicit choice of an MHA backend
for an MLA model is refused with the list of those that fit.
"""
