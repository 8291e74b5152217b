"""LFM2 (gated short convolutions + attention) through the engine against transformers on a tiny
random checkpoint (fp32): 64 greedy steps of a batch of prompts of different lengths, with prefill
chunked across steps and not, and across preemptions; its conv layers served by short_conv_attn;
``llmhal generate`` and ``llmhal serve`` on it."""

from __future__ import annotations

import pytest
import torch

from llmhal.testing.engine_parity import PROMPTS, StateModelParity, hf_references
from llmhal.testing.tiny_models import make_tiny_model


class TestLfm2(StateModelParity):
    arch = "lfm2"
    # Conv biases, an untied head, and the published MLP sizing (2/3 x 1.5, rounded up to 32).
    variant = dict(
        conv_bias=True, tie_word_embeddings=False, block_auto_adjust_ff_dim=True,
        intermediate_size=192, block_multiple_of=32, block_ffn_dim_multiplier=1.5,
    )  # fmt: skip

    def test_conv_layers_use_short_conv_attn(self, chunked_llm):
        runner = chunked_llm.engine.runner
        assert {m.kind for m in runner.state_layers} == {"short_conv"}
        assert len(runner.state_layers) == 2 and len(runner.layers) == 1
        assert "short_conv_attn" in runner.attention_backends
        (spec,) = runner.state_layers[0].state_specs()
        assert spec.shape == (2, 64)  # kernel 3 -> the last 2 inputs of 64 channels

    def test_serve_answers_like_the_offline_api(self, checkpoint, chunked_llm):
        from llmhal import SamplingParams
        from llmhal.testing.http_client import post_json, running_server

        params = SamplingParams(temperature=0, max_tokens=6)
        offline = chunked_llm.generate(["Paris is"], params)[0]
        with running_server(chunked_llm) as (url, _):
            body = {"model": checkpoint[0], "prompt": "Paris is", "max_tokens": 6, "temperature": 0}
            status, answer = post_json(f"{url}/v1/completions", body)
        assert status == 200, answer
        assert answer["choices"][0]["text"] == offline.outputs[0].text


class TestLfm2Moe(StateModelParity):
    """LFM2-MoE: a dense first layer, then sigmoid-routed experts with a per-expert choice bias
    (random here: transformers initializes it to zero, which would leave it untested)."""

    arch = "lfm2_moe"
    variant = dict(routed_scaling_factor=1.7, norm_topk_prob=False)

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tmp_path_factory):
        folder = tmp_path_factory.mktemp("lfm2_moe")
        hf = make_tiny_model(folder, "lfm2_moe")
        torch.manual_seed(1)
        for layer in hf.model.layers[1:]:
            layer.feed_forward.expert_bias.uniform_(-0.5, 0.5)
        hf.save_pretrained(folder)
        return str(folder), hf_references(hf, PROMPTS, cls.steps)

    def test_sparse_layers_route_with_the_expert_bias(self, chunked_llm):
        layers = chunked_llm.engine.runner.model.model.layers
        experts = layers[2].feed_forward.experts
        assert experts.routing["scoring_func"] == "sigmoid"
        assert experts.e_score_correction_bias.abs().sum() > 0  # loaded, not the zero default
        assert not hasattr(layers[0].feed_forward, "experts")  # num_dense_layers=1
