"""LFM2 (gated short convolutions + attention) through the engine against transformers on a tiny
random checkpoint (fp32): 64 greedy steps of a batch of prompts of different lengths, with prefill
chunked across steps and not, and across preemptions; its conv layers served by short_conv_attn;
``llmhal generate`` and ``llmhal serve`` on it; the same weights as a llama.cpp-style GGUF file."""

from __future__ import annotations

import pytest
import torch

from llmhal.testing.engine_parity import (
    PROMPTS,
    StateModelParity,
    compare_with_references,
    hf_references,
)
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


def write_lfm2_gguf(hf, path, weight_type: str) -> None:
    """The HF model as llama.cpp's converter writes an LFM2 GGUF: gguf's tensor names, KV heads per
    layer (0 on conv layers), the conv weight without its unit axis; 2-D weights of ``weight_type``
    (norms and the 3-tap conv stay F32)."""
    import gguf

    c = hf.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "lfm2")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([0 if t == "conv" else c.num_key_value_heads for t in c.layer_types])
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    w.add_shortconv_l_cache(c.conv_L_cache)
    qtype = gguf.GGMLQuantizationType[weight_type]
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, _, suffix = name.rpartition(".")
        arr = (t.squeeze(1) if name.endswith("conv.conv.weight") else t).float().numpy()
        gname = f"{names.get_name(base)}.{suffix}"
        if arr.ndim == 2 and weight_type != "F32" and arr.shape[1] % 32 == 0:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_file_matches_transformers(tiny_models, tmp_path):
    from llmhal import LLM

    folder, hf = tiny_models("lfm2")
    refs = hf_references(hf, PROMPTS, 16)
    kw = dict(tokenizer=folder, dtype="float32", max_num_seqs=4, max_num_batched_tokens=8)
    write_lfm2_gguf(hf, tmp_path / "f32.gguf", "F32")
    llm = LLM(str(tmp_path / "f32.gguf"), **kw)
    assert llm.engine.runner.model.config.layer_types == ["conv", "full_attention", "conv"]
    assert compare_with_references(llm, refs) == []
    # Q8_0 weights (through the GGUF linear kernels): the first step within quantization error.
    write_lfm2_gguf(hf, tmp_path / "q8.gguf", "Q8_0")
    first = [type(r)(r.prompt, r.tokens[:1], r.logprobs[:1]) for r in refs]
    assert compare_with_references(LLM(str(tmp_path / "q8.gguf"), **kw), first, atol=0.15) == []


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


def test_explicit_backend_applies_to_its_own_kind(tiny_models):
    """An explicit mha backend serves the attention layer; the conv layers keep short_conv_attn."""
    from llmhal import LLM, SamplingParams

    folder, _ = tiny_models("lfm2")
    llm = LLM(folder, dtype="float32", attention_backend="reference", enforce_eager=True)
    runner = llm.engine.runner
    assert [m.backend.name for m in runner.layers] == ["reference"]
    assert {m.backend.name for m in runner.state_layers} == {"short_conv_attn"}
    assert len(llm.generate(["Paris"], SamplingParams(max_tokens=3))[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    "arch,backend",
    [("lfm2", "short_conv_attn"), ("bamba", "mamba2_attn"), ("minimax", "linear_attn")],
)
def test_explicit_recurrent_backend_serves_its_kind_in_a_hybrid(tiny_models, arch, backend):
    """A recurrent backend chosen for a hybrid serves its layers; the softmax layers select by kind."""
    from llmhal import LLM, SamplingParams

    folder, _ = tiny_models(arch)
    llm = LLM(folder, dtype="float32", attention_backend=backend, enforce_eager=True)
    runner = llm.engine.runner
    assert {m.backend.name for m in runner.state_layers} == {backend}
    assert backend not in {m.backend.name for m in runner.layers}
    assert len(llm.generate(["Paris"], SamplingParams(max_tokens=3))[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("arch,backend", [("lfm2", "linear_attn"), ("llama", "mamba2_attn")])
def test_a_backend_that_serves_no_layer_is_refused(tiny_models, arch, backend):
    from llmhal import LLM
    from llmhal.attention.selector import AttentionBackendError

    folder, _ = tiny_models(arch)
    with pytest.raises(AttentionBackendError) as err:
        LLM(folder, dtype="float32", attention_backend=backend, enforce_eager=True)
    msg = str(err.value)
    assert "this model's layers are of kind" in msg and "Backends that can serve them" in msg
