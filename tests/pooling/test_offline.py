"""LLM.encode / embed / score against transformers' hidden states pooled the same way."""

from __future__ import annotations

import pytest
import torch

from llmhal.engine.sampling_params import SamplingParams
from llmhal.pooling import PoolerConfig, PoolingParams
from llmhal.pooling.outputs import EmbeddingRequestOutput, PoolingRequestOutput

# Lengths 1 (a one-token prompt looks like a decode), a few, and 37 tokens: 3 chunks of at most 16.
PROMPTS = ["a", "the cat sat", "the quick brown fox jumps over the lazy dog, " * 2 + "again"]
FP32 = dict(atol=2e-5, rtol=1e-4)


def _with_config(llm, **config):
    llm.engine.pooler_config = PoolerConfig(**config)


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS", "ALL"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooled_vectors_equal_transformers(tiny_llm, hf_pooled, kind, normalize):
    llm, hf = tiny_llm
    _with_config(llm, pooling_type=kind, normalize=normalize)
    task = "token_embed" if kind == "ALL" else "embed"
    outs = llm.encode(PROMPTS, pooling_task=task)
    assert len(outs[2].prompt_token_ids) > 2 * 16  # prefilled in 3 chunks of at most 16
    for out in outs:
        assert isinstance(out, PoolingRequestOutput) and out.finished
        ref = hf_pooled(hf, out.prompt_token_ids, kind, normalize)
        assert out.outputs.data.shape == ref.shape
        torch.testing.assert_close(out.outputs.data, ref, **FP32)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks  # no request holds a block


def test_pooling_batched_with_generation(tiny_llm, hf_pooled):
    """Pooling requests share steps with a generating one; neither changes the other."""
    llm, hf = tiny_llm
    _with_config(llm)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS[2], greedy, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    rid = engine.add_request(PROMPTS[2], greedy)
    engine.step()  # the generation is under way when the pooling requests arrive
    outs = llm.embed(PROMPTS, use_tqdm=False)
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                together = o.outputs[0].token_ids
    assert together == alone
    for out in outs:
        assert isinstance(out, EmbeddingRequestOutput)
        ref = hf_pooled(hf, out.prompt_token_ids, "LAST", True)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, **FP32)
        assert out.outputs.hidden_size == hf.config.hidden_size


def test_prefix_cache_serves_last_pooling_only(tiny_llm):
    """LAST pooling needs the last position alone, so it may reuse cached blocks; MEAN needs every
    position and computes them all."""
    llm, _ = tiny_llm
    _with_config(llm, pooling_type="LAST")
    first, again = llm.embed([PROMPTS[2]] * 2, use_tqdm=False)
    assert again.num_cached_tokens == 32 and again.outputs.embedding == pytest.approx(first.outputs.embedding, abs=1e-5)  # fmt: skip
    _with_config(llm, pooling_type="MEAN")
    assert llm.embed(PROMPTS[2], use_tqdm=False)[0].num_cached_tokens == 0


def test_score_is_cosine_similarity_of_embeddings(tiny_llm):
    llm, _ = tiny_llm
    _with_config(llm, normalize=False)
    emb = [torch.tensor(o.outputs.embedding) for o in llm.embed(PROMPTS, use_tqdm=False)]
    one_to_n = llm.score(PROMPTS[0], PROMPTS, use_tqdm=False)
    n_to_n = llm.score(PROMPTS, PROMPTS[::-1], use_tqdm=False)
    for i, out in enumerate(one_to_n):
        want = torch.nn.functional.cosine_similarity(emb[0], emb[i], dim=0)
        assert out.outputs.score == pytest.approx(float(want), abs=1e-5)
    assert one_to_n[0].outputs.score == pytest.approx(1.0, abs=1e-5)
    want = torch.nn.functional.cosine_similarity(emb[0], emb[2], dim=0)
    assert n_to_n[0].outputs.score == pytest.approx(float(want), abs=1e-5)
    with pytest.raises(ValueError, match="1 text with N, or N with N; got 2 and 3"):
        llm.score(PROMPTS[:2], PROMPTS)


def test_errors_name_the_choices(tiny_llm):
    llm, _ = tiny_llm
    _with_config(llm)
    with pytest.raises(ValueError, match="needs pooling_task"):
        llm.encode("x")
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        llm.embed("x", pooling_params=PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="a head llmhal's models do not have"):
        PoolingParams(task="token_classify")
    with pytest.raises(ValueError, match="needs a sequence-classification model"):
        llm.classify("x", use_tqdm=False)  # a causal LM: no classifier head
    with pytest.raises(ValueError, match="LAST, MEAN, CLS, ALL"):
        PoolerConfig.parse({"pooling_type": "STEP"})
    with pytest.raises(ValueError, match="not supported by llmhal"):
        PoolerConfig.parse('{"softmax": true}')
    _with_config(llm, pooling_type="ALL")
    with pytest.raises(ValueError, match="token_embed"):
        llm.embed("x")
    long = {"prompt_token_ids": [5] * 129}
    with pytest.raises(ValueError, match="context is 128 tokens"):
        llm.encode(long, pooling_task="token_embed")
    # The whole context is usable: nothing is generated after the prompt.
    assert llm.encode({"prompt_token_ids": [5] * 128}, pooling_task="token_embed")[0].outputs.data.shape[0] == 128  # fmt: skip


def test_matryoshka_dimensions(tiny_models, hf_pooled):
    from llmhal import LLM

    folder, hf = tiny_models("llama", matryoshka_dimensions=[8, 16])
    llm = LLM(folder, dtype="float32", max_model_len=64, max_num_seqs=4, pooler_config={"pooling_type": "MEAN"})  # fmt: skip
    out = llm.embed(PROMPTS[1], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)[0]
    ref = hf_pooled(hf, out.prompt_token_ids, "MEAN", True, dims=8)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, **FP32)
    with pytest.raises(ValueError, match=r"use one of \[8, 16\]"):
        llm.embed("x", pooling_params=PoolingParams(dimensions=12))


def test_qwen3_pools_like_transformers(tiny_models, hf_pooled):
    from llmhal import LLM

    folder, hf = tiny_models("qwen3")
    llm = LLM(folder, dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, pooler_config={"pooling_type": "MEAN"})  # fmt: skip
    for out in llm.embed(PROMPTS, use_tqdm=False):
        ref = hf_pooled(hf, out.prompt_token_ids, "MEAN", True)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, **FP32)


def test_preempted_pooling_requests_pool_the_same(tiny_models, tiny_llm, hf_pooled, monkeypatch):
    """A KV cache of 5 blocks: generating requests grow and preempt the pooling ones mid-prompt;
    those are recomputed from their first position and still pool like transformers."""
    from llmhal import LLM

    folder, hf = tiny_models("llama")
    per_block = tiny_llm[0].engine.runner.kv_cache_bytes_per_block()  # the same model
    llm = LLM(folder, dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, kv_cache_memory_bytes=5 * per_block, enable_prefix_caching=False, pooler_config={"pooling_type": "MEAN"})  # fmt: skip
    engine = llm.engine
    victims = []
    preempt = engine.scheduler._preempt
    monkeypatch.setattr(engine.scheduler, "_preempt", lambda r: (victims.append(r.pooling is not None), preempt(r)))  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for _ in range(2):
        engine.add_request(PROMPTS[1], greedy)
    engine.step()
    outs = llm.encode([PROMPTS[2]] * 4, pooling_task="embed", use_tqdm=False)
    while engine.has_unfinished_requests():
        engine.step()
    assert any(victims), victims  # a pooling request was preempted
    for out in outs:
        ref = hf_pooled(hf, out.prompt_token_ids, "MEAN", True)
        torch.testing.assert_close(out.outputs.data, ref, **FP32)
