"""Bamba (Mamba-2 layers + attention layers) through the engine against transformers on a tiny
random checkpoint (fp32): 64 greedy steps of a batch of prompts of different lengths (the longest
crosses a 16-token SSD chunk), prefill chunked and not, across preemptions. Its attention layer
holds KV blocks and its Mamba layers one state slot per request, both from one budget."""

from __future__ import annotations

from llmhal.testing.engine_parity import StateModelParity


class TestBamba(StateModelParity):
    arch = "bamba"
    long_overrides = dict(mamba_chunk_size=256)
    # Two SSM groups, projection and attention/MLP biases, no conv bias.
    variant = dict(
        mamba_n_groups=2, mamba_proj_bias=True, mamba_conv_bias=False, attention_bias=True,
        mlp_bias=True,
    )  # fmt: skip

    def test_hybrid_layers_and_backends(self, chunked_llm):
        runner = chunked_llm.engine.runner
        assert [m.kind for m in runner.state_layers] == ["mamba2", "mamba2"]
        assert len(runner.layers) == 1 and runner.layers[0].backend.kind == "mha"
        assert "mamba2_attn" in runner.attention_backends
        # Half of each 16-dim head is rotated (transformers fixes Bamba's partial_rotary_factor).
        assert runner.model.rotary_emb.rotary_dim == 8
