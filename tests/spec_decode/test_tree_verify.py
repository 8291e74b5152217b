"""Draft trees verified in one forward through tree_attn: the acceptance rules alone (greedy walks,
sampled multi-candidate acceptance keeps the target's distribution), then end to end on the tiny
Llama with a drafter that hides the right continuation on random branches: greedy output equals
plain decoding, the accepted path's KV is moved into place, and no request ever reads KV written
for a rejected node (that KV is overwritten with huge values after every step)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from llmhal import SamplingParams
from llmhal.spec_decode import Proposer, register_proposer
from llmhal.spec_decode.tree_verify import (
    DraftTree,
    TreeDraft,
    accept_greedy_tree,
    accept_sampled_tree,
    default_tree,
)

# Three choices at the first depth, two below the first two, a third level under two of them.
PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0], [1, 0, 0], [1, 1, 0]]
PROMPTS = [
    {"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7]},
    {"prompt_token_ids": list(range(30, 70))},
    {"prompt_token_ids": [100, 200, 100, 200, 100]},
    {"prompt_token_ids": [9]},
]


def _stats_helper():
    """test_distribution's chi-square helper (test folders are not packages here)."""
    path = Path(__file__).with_name("test_distribution.py")
    spec = importlib.util.spec_from_file_location("_spec_distribution", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class HiddenPathProposer(Proposer):
    """Drafts PATHS' tree for every request; the plain continuation (``answers``) sits on a random
    branch for a random number of levels, every other node holds a wrong token."""

    answers: dict[tuple[int, ...], list[int]] = {}
    drafts_trees = True
    tree, ranks = DraftTree.from_paths(PATHS)

    def __init__(self, config, engine_config) -> None:
        super().__init__(config, engine_config)
        self.rng = random.Random(0)
        self.vocab = engine_config.model.hf_config.vocab_size

    def propose(self, requests):
        out = []
        for r in requests:
            full = self.answers.get(tuple(r.prompt_token_ids), [])
            done = len(r.output_token_ids)
            right = full[done : done + self.tree.depth]
            # The branch the right tokens take: a random rank path of the tree, cut at random.
            path = self.rng.choice([p for p in self.ranks if len(p) == self.tree.depth])
            path = path[: self.rng.randrange(len(path) + 1)]
            tokens = []
            for ranks in self.ranks:
                d = len(ranks)
                on_path = ranks == path[:d] and d <= len(path) and d <= len(right)
                tok = right[d - 1] if on_path else self.rng.randrange(self.vocab)
                if not on_path and d <= len(right) and tok == right[d - 1]:
                    tok = (tok + 1) % self.vocab  # a wrong node is really wrong
                tokens.append(tok)
            out.append(TreeDraft(tokens, self.tree))
        return out


class HiddenRecordingProposer(HiddenPathProposer):
    """The same trees, and a record of the target's hidden states handed over with each call."""

    uses_target_hidden_states = True
    records: list[tuple[list[int], int, torch.Tensor]] = []

    def propose(self, requests):
        for r in requests:
            if r.hidden_states is not None:
                ids = [*r.prompt_token_ids, *r.output_token_ids]
                self.records.append((ids, r.hidden_start, r.hidden_states.clone()))
        return super().propose(requests)


register_proposer("test_hidden_path", HiddenPathProposer)
register_proposer("test_hidden_path_recording", HiddenRecordingProposer)


# ------------------------------------------------------------------------------- the rules
def test_tree_shape_from_paths_orders_the_top1_chain_first():
    tree, ranks = DraftTree.from_paths(PATHS)
    assert ranks[:3] == [(0,), (0, 0), (0, 0, 0)]
    assert tree.chain_len == 3 and tree.depth == 3 and tree.num_nodes == 10
    assert all(p < i for i, p in enumerate(tree.parents, start=1))
    m = tree.mask
    for i in range(1, 11):  # a node sees exactly itself and its ancestors
        assert set(torch.nonzero(m[i]).flatten().tolist()) == {0, *tree.path(i)}
    assert DraftTree.from_paths(default_tree(3))[0].num_nodes == 6


def test_greedy_walk_follows_the_argmax_through_branches():
    tree, ranks = DraftTree.from_paths(PATHS)
    tokens = [10 + i for i in range(tree.num_nodes)]
    node_11 = ranks.index((1,)) + 1
    node_110 = ranks.index((1, 1, 0)) + 1
    node_11_mid = ranks.index((1, 1)) + 1
    argmax = [0] * (tree.num_nodes + 1)
    argmax[0] = tokens[node_11 - 1]
    argmax[node_11] = tokens[node_11_mid - 1]
    argmax[node_11_mid] = tokens[node_110 - 1]
    argmax[node_110] = 99  # the bonus token after a leaf
    out, rows = accept_greedy_tree(argmax, tokens, tree)
    assert out == [tokens[node_11 - 1], tokens[node_11_mid - 1], tokens[node_110 - 1], 99]
    assert rows == [0, node_11, node_11_mid, node_110]
    argmax[0] = 5  # no child holds it: one token, the target's
    assert accept_greedy_tree(argmax, tokens, tree) == ([5], [0])


def test_sampled_tree_acceptance_keeps_the_target_distribution():
    """The first two emitted tokens over 20000 walks match p(t1) and p(t2 | t1) exactly."""
    chi = _stats_helper()._chi_square_p
    tree, ranks = DraftTree.from_paths([[0], [1], [0, 0], [1, 0], [1, 1]])
    vocab = 6
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(tree.num_nodes + 1, vocab, generator=g) * 1.5, -1)
    # Drafts: root's children 1 and 2 hold tokens 0 and 1, their children other tokens.
    tokens = [0, 2, 1, 3, 0]
    first_counts = torch.zeros(vocab)
    second = {0: torch.zeros(vocab), 1: torch.zeros(vocab)}
    n = 20000
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        out, rows = accept_sampled_tree(probs, tokens, tree, gen)
        first_counts[out[0]] += 1
        if len(out) > 1:
            second[out[0]][out[1]] += 1
    assert chi(first_counts, probs[0]) > 1e-3
    node_of = {tokens[c - 1]: c for c in tree.children[0]}
    for t, counts in second.items():
        assert counts.sum() > 300
        assert chi(counts, probs[node_of[t]]) > 1e-3
    shifted = probs[0].clone()
    shifted[shifted.argmax()] *= 1.1
    assert chi(first_counts, shifted / shifted.sum()) < 1e-3  # the test can tell


# ------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def answers(base_llm):
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for p, out in zip(PROMPTS, base_llm.generate(PROMPTS, sp), strict=True):
        HiddenPathProposer.answers[tuple(p["prompt_token_ids"])] = out.outputs[0].token_ids
    return HiddenPathProposer.answers


def _poison_unwritten_kv(engine, value=1e4):
    """After every step, fill every running request's KV past its computed tokens (rejected
    nodes' KV among it) with ``value`` in every layer: a later step that attended to any of it
    would change the output."""
    step = engine.step

    def poisoned():
        outs = step()
        bs = engine.kv.block_size
        for req in engine.scheduler.running:
            ids = torch.tensor(req.block_ids, dtype=torch.long)
            pos = torch.arange(req.num_computed_tokens, len(req.block_ids) * bs)
            slots = ids[pos // bs] * bs + pos % bs
            for layer in engine.runner.layers:
                kv = layer.kv_cache
                kv.view(2, -1, *kv.shape[3:])[:, slots] = value
        return outs

    engine.step = poisoned


@pytest.fixture(scope="module")
def tree_llm(new_llm, answers):
    """An engine verifying HiddenPathProposer's trees, its unwritten KV poisoned after each step."""
    llm = new_llm({"method": "test_hidden_path", "num_speculative_tokens": 3}, max_num_seqs=4)
    _poison_unwritten_kv(llm.engine)
    return llm


def test_tree_greedy_equals_plain_and_rejected_kv_is_never_read(tree_llm, base_llm):
    llm = tree_llm
    assert llm.engine.runner.attention_backends == ["tree_attn"]
    for max_tokens in (40, 7):  # 7: trees cut to chains near max_tokens
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        plain = [o.outputs[0].token_ids for o in base_llm.generate(PROMPTS, params)]
        spec = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert spec == plain
    stats = llm.engine.speculator.stats
    assert stats.mean_acceptance_length > 1.8  # accepted paths ran through branches
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_tree_rows_keep_their_own_history_and_logprobs(tree_llm, base_llm):
    """Penalties see each node's own path as history, and log-probabilities come from the rows
    of the accepted path (not the nodes that follow in node order)."""
    llm = tree_llm
    for params in (
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3),
        SamplingParams(
            temperature=0,
            max_tokens=30,
            ignore_eos=True,
            repetition_penalty=1.3,
            presence_penalty=0.5,
        ),  # fmt: skip
    ):
        plain = base_llm.generate(PROMPTS, params)
        spec = llm.generate(PROMPTS, params)
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
        for a, b in zip(plain, spec, strict=True):
            for la, lb in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):  # fmt: skip
                assert la.keys() == lb.keys()
                assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)
    assert llm.engine.speculator.stats.num_accepted_tokens > 0


def test_hidden_states_after_a_tree_step_are_the_accepted_paths(new_llm, answers, tiny_models, monkeypatch):  # fmt: skip
    """A proposer reading the target's hidden states gets, after a tree verification, the rows of
    the accepted path (moved into place like its KV): equal to transformers' hidden states of the
    committed tokens."""
    import llmhal.spec_decode.speculator as speculator

    moved = []
    real = speculator.compact_path_kv
    monkeypatch.setattr(speculator, "compact_path_kv", lambda *a: (moved.append(a[-1]), real(*a)))
    HiddenRecordingProposer.records.clear()
    llm = new_llm({"method": "test_hidden_path_recording", "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate(PROMPTS[:2], params)
    assert any(path != list(range(len(path))) for path in moved)  # branches were accepted
    _, hf = tiny_models("llama")
    records = HiddenRecordingProposer.records
    assert len(records) > 4
    with torch.no_grad():
        for ids, start, rows in records:
            ref = hf(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states[-1][0]
            assert torch.allclose(rows, ref[start:], atol=1e-4), (start, len(ids))


def test_tree_with_preemption_chunked_prefill_and_trimmed_trees(new_llm, base_llm, answers):
    per_block = base_llm.engine.runner.kv_cache_bytes_per_block()
    small = new_llm(
        {"method": "test_hidden_path", "num_speculative_tokens": 3},
        kv_cache_memory_bytes=6 * per_block, max_num_batched_tokens=16, max_num_seqs=4,
    )  # fmt: skip
    _poison_unwritten_kv(small.engine)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS + PROMPTS
    plain = [o.outputs[0].token_ids for o in base_llm.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params)] == plain
    assert small.engine.stats.preemptions > 0
    assert small.engine.speculator.stats.num_accepted_tokens > 0


@pytest.mark.slow  # ~30 s: 3000 requests
def test_tree_sampling_keeps_the_second_token_marginal(new_llm, tiny_folder):
    """End to end: the second sampled token's frequencies equal the exact marginal (from
    transformers) while trees with likely tokens on random branches are verified."""
    from transformers import AutoModelForCausalLM

    helper = _stats_helper()
    prompt, temp = helper.PROMPT, helper.TEMPERATURE
    hf = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double() / temp, -1)
        seqs = torch.tensor([prompt + [t] for t in range(p1.numel())])
        p2 = torch.softmax(hf(seqs).logits[:, -1].double() / temp, -1)
    marginal = p1 @ p2
    first = int(p1.argmax())
    HiddenPathProposer.answers[tuple(prompt)] = [first, int(p2[first].argmax()), 0, 0]
    llm = new_llm({"method": "test_hidden_path", "num_speculative_tokens": 3}, max_num_seqs=128, max_num_batched_tokens=1024)  # fmt: skip
    n = 3000
    params = SamplingParams(temperature=temp, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params)
    second = torch.bincount(torch.tensor([o.outputs[0].token_ids[1] for o in outs]), minlength=marginal.numel())  # fmt: skip
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_drafts * 3
    assert helper._chi_square_p(second.float(), marginal) > 1e-3
