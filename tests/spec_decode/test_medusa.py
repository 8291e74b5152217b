"""Medusa heads (vLLM's layout, tiny random ones built here) on the tiny Llama: greedy output equals
plain decoding token for token, batched and through preemption, whether the heads draft a tree
(verified through tree_attn) or a chain; heads that copy the target's own next-token guess are
accepted often; bad checkpoints are refused before anything runs."""

from __future__ import annotations

import json
import re

import pytest
import torch

from llmhal import SamplingParams
from llmhal.spec_decode.tree_verify import default_tree

PROMPTS = [
    {"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7]},
    {"prompt_token_ids": list(range(30, 70))},
    {"prompt_token_ids": [100, 200, 100, 200, 100]},
    {"prompt_token_ids": [9]},
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def save_medusa(folder, hidden, vocab, heads=3, layers=1, *, lm_head=None, seed=0, bias=True):
    """Random Medusa heads in vLLM's layout; ``lm_head`` (a [vocab, hidden] tensor) replaces each
    head's own, with the residual blocks zeroed: every head then guesses the target's next token."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for h in range(heads):
        for layer in range(layers):
            w = torch.randn(hidden, hidden, generator=g) * 0.1
            tensors[f"blocks.{h}.layers.{layer}.weight"] = w if lm_head is None else w * 0
            if bias:
                tensors[f"blocks.{h}.layers.{layer}.bias"] = torch.zeros(hidden)
        head = torch.randn(vocab, hidden, generator=g) if lm_head is None else lm_head
        tensors[f"lm_heads.{h}.weight"] = head.clone().contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "model_type": "medusa",
        "num_heads": heads,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "medusa_fc_bias": bias,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def target(tiny_models):
    folder, hf = tiny_models("llama")
    return folder, hf


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    _, hf = target
    cfg = hf.config
    return save_medusa(tmp_path_factory.mktemp("medusa"), cfg.hidden_size, cfg.vocab_size)


@pytest.fixture(scope="module")
def echo_heads(target, tmp_path_factory):
    """Heads that guess the target's own next token at every depth (accepted when it repeats)."""
    _, hf = target
    cfg = hf.config
    w = hf.lm_head.weight.detach().float()
    return save_medusa(tmp_path_factory.mktemp("medusa_echo"), cfg.hidden_size, cfg.vocab_size, lm_head=w)  # fmt: skip


@pytest.fixture(scope="module")
def plain(base_llm):
    return [o.outputs[0].token_ids for o in base_llm.generate(PROMPTS, GREEDY)]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


TREE = [list(p) for p in default_tree(3)]  # the top-1 chain and the second choice at each depth


def test_tree_drafts_verified_through_tree_attn_equal_plain_decoding(new_llm, heads, plain):
    llm = new_llm({"method": "medusa", "model": heads, "num_speculative_tokens": 3, "medusa_choices": TREE})  # fmt: skip
    assert llm.engine.runner.attention_backends == ["tree_attn"]  # chosen through the registry
    assert llm.engine.speculator.proposer.drafts_trees
    assert _ids(llm.generate(PROMPTS, GREEDY)) == plain
    stats = llm.engine.speculator.stats
    assert stats.num_drafts > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_echo_heads_are_accepted_and_exact_in_tree_and_chain(new_llm, echo_heads, plain):
    for choices in (TREE, None):
        spec = {"method": "medusa", "model": echo_heads, "num_speculative_tokens": 3}
        if choices:
            spec["medusa_choices"] = choices  # else the top-1 chain, on the model's own backend
        llm = new_llm(spec)
        assert _ids(llm.generate(PROMPTS, GREEDY)) == plain
        stats = llm.engine.speculator.stats
        assert stats.num_accepted_tokens > 0
        assert (llm.engine.runner.attention_backends == ["tree_attn"]) == (choices is not None)


def test_preemption_and_batching_beside_plain_requests(new_llm, base_llm, heads, plain):
    # A KV cache of 6 blocks and a small step budget: requests are preempted and resumed, and
    # trees are trimmed to chains.
    per_block = base_llm.engine.runner.kv_cache_bytes_per_block()
    llm = new_llm(
        {"method": "medusa", "model": heads, "num_speculative_tokens": 3, "medusa_choices": TREE},
        kv_cache_memory_bytes=6 * per_block, max_num_batched_tokens=16, max_num_seqs=4,
    )  # fmt: skip
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), GREEDY, GREEDY]
    outs = llm.generate(PROMPTS, params)
    assert _ids(outs) == plain
    assert llm.engine.stats.preemptions > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_bad_heads_are_refused_before_loading(new_llm, target, tmp_path):
    _, hf = target
    cfg = hf.config
    wrong = save_medusa(tmp_path / "wrong", cfg.hidden_size + 8, cfg.vocab_size)
    with pytest.raises(ValueError, match="hidden_size"):
        new_llm({"method": "medusa", "model": wrong, "num_speculative_tokens": 2})
    few = save_medusa(tmp_path / "few", cfg.hidden_size, cfg.vocab_size, heads=2)
    with pytest.raises(ValueError, match="2 heads"):
        new_llm({"method": "medusa", "model": few, "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="needs 'model'"):
        new_llm({"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="medusa_choices"):
        new_llm({"method": "medusa", "model": few, "num_speculative_tokens": 2, "medusa_choices": [[0, -1]]})  # fmt: skip
    big = [[0], [cfg.vocab_size]]  # a rank past the vocabulary: top-k would fail mid-serving
    with pytest.raises(ValueError, match=f"medusa_choices.*rank {cfg.vocab_size}.*below {cfg.vocab_size}"):  # fmt: skip
        new_llm({"method": "medusa", "model": few, "num_speculative_tokens": 2, "medusa_choices": big})  # fmt: skip


def test_an_explicit_backend_that_cannot_verify_trees_is_refused(new_llm, heads):
    spec = {"method": "medusa", "model": heads, "num_speculative_tokens": 3, "medusa_choices": TREE}
    with pytest.raises(ValueError, match="kind 'tree'.*tree_attn"):
        new_llm(spec, attention_backend="reference")


def test_heads_made_from_the_models_own_generations(new_llm, tmp_path, plain):
    """llmhal.spec_decode.medusa_heads: hidden states kept while generating, residual blocks
    fitted to later hidden states (closer than the untrained, echoing head), saved in vLLM's
    layout with the target's LM head, and loaded back as exact drafts."""
    from llmhal.spec_decode.medusa_heads import collect_hidden, make_heads, train_heads

    llm = new_llm()
    seqs = collect_hidden(llm, ["hello there", "a b c"], max_tokens=24)
    assert len(seqs) == 2 and all(len(s) > 20 for s in seqs)
    (head,) = train_heads(seqs, 1, steps=100)
    x = torch.cat([s[:-1] for s in seqs])
    y = torch.cat([s[1:] for s in seqs])
    fitted = x + torch.nn.functional.silu(x @ head["weight"].T + head["bias"])
    assert torch.nn.functional.mse_loss(fitted, y) < torch.nn.functional.mse_loss(x, y)
    info = make_heads(tmp_path / "heads", llm=llm, prompts=["hello there"], max_tokens=16)
    assert info["original_lm_head"] and info["samples"] > 10
    spec = new_llm({"method": "medusa", "model": str(tmp_path / "heads"), "num_speculative_tokens": 3})  # fmt: skip
    assert _ids(spec.generate(PROMPTS, GREEDY)) == plain


@pytest.mark.parametrize(
    ("choices", "problem"),
    [
        ([[0, -1]], "not a non-empty path of ranks >= 0"),
        ([[0], [True]], "not a non-empty path of ranks >= 0"),  # a bool is not a rank
        ([[0], [0]], "lists a path twice"),
        ("[(0,), (1,", "is not a Python or JSON literal"),
        ([[r, 0] for r in range(65)], "has 130 nodes, more than 128"),  # prefixes count too
        ([[0, 0, 0]], "3 deep, more than"),
    ],
)
def test_medusa_choices_are_checked_like_eagle_trees(choices, problem):
    """``medusa_choices`` goes through the tree parser EAGLE's ``speculative_token_tree`` uses (a
    string of a list is accepted), except that a path's prefixes need not be listed; each refusal
    names the key and the problem, before any checkpoint is read."""
    from types import SimpleNamespace

    from llmhal.spec_decode.medusa import MedusaProposer

    def config(value):
        extra = {"medusa_choices": value}
        return SimpleNamespace(model="heads", num_speculative_tokens=2, extra=extra)

    with pytest.raises(ValueError, match=rf"medusa_choices.*{re.escape(problem)}"):
        MedusaProposer.check_config(config(choices))
    MedusaProposer.check_config(config("[[0, 1], [1]]"))  # (0,) is implied by (0, 1)
    assert MedusaProposer._choices({"medusa_choices": "[[0, 1], [1]]"}) == [(0, 1), (1,)]
