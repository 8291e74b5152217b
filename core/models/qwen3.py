"""Qwen3: the Llama decoder with a per-head RMSNorm on queries and keys before RoPE."""

from __future__ import annotations

from llmhal.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """``q_norm``/``k_norm`` normalise each head; biases follow ``attention_bias``; sliding-window
    layers follow ``layer_types`` as in Qwen2."""

    qk_norm = True
    supports_sliding_window = True
