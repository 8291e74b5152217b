"""Qwen2: the Llama decoder with biased q/k/v projections and per-layer sliding windows."""

from __future__ import annotations

from llmhal.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """q/k/v projections always carry a bias, the output projection never does. Sliding-window
    layers follow the config's ``layer_types`` (or ``use_sliding_window``/``max_window_layers``)."""

    force_qkv_bias = True
    qkv_bias_attr = None
    o_bias_attr = None
    supports_sliding_window = True
