"""MiniMax-Text-01 (lightning attention + softmax attention, MoE MLP) through the engine against
transformers on a tiny random checkpoint (fp32): 64 greedy steps of a batch of prompts of
different lengths (the longest crosses a 16-token lightning block), prefill chunked and not,
across preemptions; its lightning layers served by linear_attn."""

from __future__ import annotations

import torch

from llmhal.testing.engine_parity import StateModelParity


class TestMiniMax(StateModelParity):
    arch = "minimax"
    long_overrides = dict(block_size=256)
    # Scaled residuals and a sliding window on the softmax layer. With a window, transformers'
    # cached decode departs from its own uncached forward (which llmhal matches to 2e-6), so the
    # uncached forward is the reference.
    variant = dict(
        linear_attn_alpha_factor=0.5, linear_attn_beta_factor=1.5, full_attn_alpha_factor=0.7,
        mlp_alpha_factor=1.2, mlp_beta_factor=0.8, sliding_window=6,
    )  # fmt: skip
    variant_hf_cache = False

    def test_lightning_layers_use_linear_attn(self, chunked_llm):
        runner = chunked_llm.engine.runner
        assert [m.kind for m in runner.state_layers] == ["linear", "linear"]
        assert "linear_attn" in runner.attention_backends and len(runner.layers) == 1
        (spec,) = runner.state_layers[0].state_specs()
        assert spec.shape == (4, 16, 16) and spec.dtype == torch.float32
        # The decay rates follow the depth (the last layer nearly none), as the checkpoint's buffers.
        first, last = (m.decay for m in runner.state_layers)
        assert torch.all(last < first * 1e-3)

    def test_published_config_keys(self, tiny_models):
        """MiniMax-Text-01's own config.json: ``rotary_dim`` (RoPE on part of each head, as its
        code and vLLM apply it) and ``attn_type_list`` (1 = softmax) instead of ``layer_types``."""
        from llmhal import LLM, SamplingParams

        folder, _ = tiny_models("minimax", rotary_dim=8, attn_type_list=[1, 0, 1], layer_types=None)
        llm = LLM(folder, dtype="float32", enforce_eager=True)
        runner = llm.engine.runner
        assert runner.model.rotary_emb.rotary_dim == 8
        # (transformers builds its default pattern, which this attn_type_list spells out)
        assert [m.layer_name for m in runner.state_layers] == ["model.layers.1.self_attn"]
        assert len(runner.layers) == 2
        out = llm.generate(["Paris is"], SamplingParams(temperature=0, max_tokens=4))[0]
        assert len(out.outputs[0].token_ids) == 4
