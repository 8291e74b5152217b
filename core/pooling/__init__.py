"""Pooling: embeddings and per-token hidden states from a decoder's final hidden states.

A pooling request runs through the same engine as generation (batched with it, prefilled in chunks)
but is never sampled: the model runner hands its prompt positions' final hidden states (before the
LM head) to a :class:`~llmhal.pooling.pooler.PoolingState`, and the request ends when its prompt is
computed, its KV blocks freed. See :mod:`llmhal.pooling.params` for what can be asked for.
Importing this package is cheap (no torch).
"""

from llmhal.pooling.params import POOLING_TYPES, PoolerConfig, PoolingParams

__all__ = ["POOLING_TYPES", "PoolerConfig", "PoolingParams"]
