"""EAGLE ("eagle"): a tiny random head in the published layout (config.json + safetensors, built
here with transformers' own Llama classes) drafts from the target's hidden states. Its drafts equal
a reference computed with transformers (the head recomputed over the whole context each draft);
greedy output equals plain decoding beside other requests and under preemption; acceptance is
counted; a head that does not fit the target is refused before anything loads."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from llmhal import SamplingParams
from llmhal.spec_decode.tree_verify import DraftTree, TreeDraft, parse_token_tree

PROMPTS = [
    {"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7]},
    {"prompt_token_ids": list(range(30, 70))},
    {"prompt_token_ids": [100, 200, 100, 200, 100]},
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# A draft tree as vLLM spells it: three choices at depth 1, two under the first, one under the
# second, the top-1 chain three deep. BRANCH: a path off the chain, where replayed answers go.
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"
SHAPE, RANKS = DraftTree.from_paths(parse_token_tree(TREE, "test"))
BRANCH = RANKS.index((1, 0)) + 1


def sibling(name):
    """Another test module of this folder (tests are not a package; imported by path)."""
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_spec_decode_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def head_config(target_cfg, **over):
    """The head's Llama config: the target's sizes, one layer."""
    import transformers

    same = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings")  # fmt: skip
    d = {k: getattr(target_cfg, k) for k in same} | {"num_hidden_layers": 1, "initializer_range": 0.15}  # fmt: skip
    d.update(over)
    return transformers.LlamaConfig(**d)


def make_eagle_head(folder, target_cfg, seed=0, **over):
    """An EAGLE-1 head as published: fc (with bias) over [embedding; hidden], one decoder layer
    without input_layernorm. Returns the transformers modules it was taken from (the reference)."""
    import transformers

    torch.manual_seed(seed)
    cfg = head_config(target_cfg, **over)
    ref = transformers.LlamaModel(cfg).eval()
    ref.layers[0].input_layernorm = nn.Identity()  # EAGLE's first layer reads fc's output as is
    ref.norm = nn.Identity()  # EAGLE's output goes to the LM head un-normed
    fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
    tensors = {f"layers.0.{k}": v for k, v in ref.layers[0].state_dict().items()}
    tensors |= {"fc.weight": fc.weight.data, "fc.bias": fc.bias.data}
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    d = cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(d))
    return ref, fc


def llm_over(folder, spec=None, **kw):
    """An engine over ``folder`` (float32, 256 tokens of context), speculating with ``spec``."""
    from llmhal import LLM

    kw.setdefault("max_model_len", 256)
    return LLM(folder, dtype="float32", speculative_config=spec, **kw)


def check_batched_and_preempted(folder, base, spec, monkeypatch, branch=None):
    """Greedy output of ``spec`` over ``folder`` equals ``base``'s plain output: five requests in
    a cache of six blocks (preempted and recomputed, chunked by a 12-token step budget, repeats
    cached), first with the head's own drafts, then with replayed answers (runs accepted)."""
    per_block = base.engine.runner.kv_cache_bytes_per_block()
    small = llm_over(folder, spec, kv_cache_memory_bytes=6 * per_block, max_num_batched_tokens=12, max_num_seqs=3)  # fmt: skip
    prompts = PROMPTS + PROMPTS[:2]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain, answers = plain_answers(base, prompts, params)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params)] == plain
    seen = record_drafts(small, monkeypatch, answers, branch)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params)] == plain
    stats = small.engine.speculator.stats
    assert small.engine.stats.preemptions > 0
    assert stats.num_accepted_tokens > 0
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    assert not small.engine.speculator._hidden and not small.engine.speculator.proposer._seqs
    return seen


def deep_target(tiny_models):
    """A 6-layer tiny Llama (inner layers to tap: EAGLE-3's default (2, 3, 3) exist), its
    transformers model, and a plain engine over it."""
    folder, hf = tiny_models("llama", num_hidden_layers=6)
    return folder, hf.eval(), llm_over(folder)


def replayed_calls(llm, base, monkeypatch, branch=None):
    """Two prompts through ``llm`` with replayed answers as drafts (output checked equal to
    ``base``'s, some drafts accepted; on ``branch`` for trees); returns every proposer call (see
    record_drafts)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain, answers = plain_answers(base, PROMPTS[:2], params)
    seen = record_drafts(llm, monkeypatch, answers, branch)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)] == plain
    assert llm.engine.speculator.stats.num_accepted_tokens > 0
    calls = [c for per in seen.values() for c in per]
    assert len(calls) >= 4
    assert sum(len(_tokens(c[3])) for c in calls) >= 2 * len(calls)  # the head drafted
    return calls


def _tokens(draft):
    return draft.tokens if isinstance(draft, TreeDraft) else draft


@pytest.fixture(scope="module")
def target(tiny_models):
    folder, hf = tiny_models("llama")
    return folder, hf.eval()


@pytest.fixture(scope="module")
def head(tmp_path_factory, target):
    folder = tmp_path_factory.mktemp("eagle_head")
    ref, fc = make_eagle_head(folder, target[1].config)
    return str(folder), ref, fc


@pytest.fixture(scope="module")
def eagle_llm(new_llm, head):
    return new_llm({"method": "eagle", "model": head[0], "num_speculative_tokens": 3})


def plain_answers(base_llm, prompts, params):
    """The plain greedy outputs (to compare with) and prompt -> tokens (to replay as drafts)."""
    plain = [o.outputs[0].token_ids for o in base_llm.generate(prompts, params)]
    return plain, {tuple(p["prompt_token_ids"]): t for p, t in zip(prompts, plain, strict=True)}


def record_drafts(llm, monkeypatch, answers=None, branch=None):
    """Wrap the engine's proposer: every (context, hidden_start, hidden rows, head's drafts) per
    request. With ``answers`` (prompt -> plain greedy tokens) the head still runs, but the drafts
    verified are those answers, every third one wrong: runs of accepted drafts, so the hidden
    states of accepted tokens and the head's kept keys after them are exercised too. A tree draft
    keeps the head's tokens but for the path to node ``branch``, which holds the answers (paths
    off the top-1 chain accepted: their KV and hidden states are moved into place)."""
    proposer = llm.engine.speculator.proposer
    seen: dict[str, list] = {}
    inner = proposer.propose

    def propose(requests):
        out = inner(requests)
        verified = []
        for r, d in zip(requests, out, strict=True):
            ctx = [*r.prompt_token_ids, *r.output_token_ids]
            seen.setdefault(r.request_id, []).append((ctx, r.hidden_start, r.hidden_states, d if isinstance(d, TreeDraft) else list(d)))  # fmt: skip
            if answers is None:
                verified.append(d)
                continue
            done = len(r.output_token_ids)
            full = answers[tuple(r.prompt_token_ids)]
            if isinstance(d, TreeDraft):
                tokens = list(d.tokens)
                for j, node in enumerate(d.tree.path(branch)):
                    tokens[node - 1] = full[done + j]
                verified.append(TreeDraft(tokens, d.tree))
                continue
            verified.append([t if (done + j) % 3 != 2 else (t + 1) % 384 for j, t in enumerate(full[done : done + r.max_draft])])  # fmt: skip
        return verified

    monkeypatch.setattr(proposer, "propose", propose)
    return seen


def reference_drafts(hf_target, ref, fc, ctx, k):
    """EAGLE's drafts recomputed from scratch with transformers: the head over positions
    0 .. n-2 (token i + 1 with the target's last hidden state at i), then one more position per
    draft (the draft token with the head's own previous output)."""
    with torch.no_grad():
        ids = torch.tensor([ctx])
        h = hf_target.model(ids).last_hidden_state[0]  # after the final norm
        emb = hf_target.get_input_embeddings()
        x = fc(torch.cat([emb(ids[0, 1:]), h[:-1]], -1))
        drafts = []
        for _ in range(k):
            out = ref(inputs_embeds=x[None], position_ids=torch.arange(x.shape[0])[None]).last_hidden_state[0]  # fmt: skip
            d = int(hf_target.lm_head(out[-1]).argmax())
            drafts.append(d)
            x = torch.cat([x, fc(torch.cat([emb(torch.tensor([d])), out[-1:]], -1))])
        return drafts


def reference_logits(hf_target, ref, fc, ctx, after):
    """EAGLE's logits for the token after ``ctx`` and the draft tokens ``after``, recomputed from
    scratch with transformers (as reference_drafts, with given drafts instead of the argmax)."""
    with torch.no_grad():
        ids = torch.tensor([ctx])
        h = hf_target.model(ids).last_hidden_state[0]
        emb = hf_target.get_input_embeddings()
        x = fc(torch.cat([emb(ids[0, 1:]), h[:-1]], -1))
        for t in [*after, None]:
            out = ref(inputs_embeds=x[None], position_ids=torch.arange(x.shape[0])[None]).last_hidden_state[0]  # fmt: skip
            if t is None:
                return hf_target.lm_head(out[-1])
            x = torch.cat([x, fc(torch.cat([emb(torch.tensor([t])), out[-1:]], -1))])


def reference_tree(logits_after, to_target=int):
    """TREE's tokens node by node: node (r1, .., rd) holds the rank-rd token of the head's logits
    (``logits_after(ancestors' tokens)``) after its ancestors."""
    tokens = []
    for node, path in enumerate(RANKS, start=1):
        before = [tokens[a - 1] for a in SHAPE.path(node)[:-1]]
        tokens.append(to_target(logits_after(before).topk(path[-1] + 1).indices[-1]))
    return tokens


def check_tree_calls(llm, base, monkeypatch, hidden_want, logits_ref, chain_ref, to_target=int):
    """TREE drafted and verified through tree_attn with replayed answers on BRANCH (output equal
    to ``base``'s); every call's hidden rows equal ``hidden_want(ctx)[start:]``, its tree the
    reference's (node by node from ``logits_ref(ctx, ancestors' tokens)``), a chain (a request
    near max_tokens) ``chain_ref(ctx, k)``. Then one request drafted by hand: the head's logits at
    every node with children equal the reference's (the tree mask and positions in the head)."""
    proposer = llm.engine.speculator.proposer
    assert llm.engine.runner.attention_backends == ["tree_attn"] and proposer.drafts_trees
    llm.engine.speculator.reset_stats()
    calls = replayed_calls(llm, base, monkeypatch, BRANCH)
    trees = 0
    for ctx, start, hidden, draft in calls:
        torch.testing.assert_close(hidden, hidden_want(ctx)[start : len(ctx) - 1], atol=1e-4, rtol=1e-4)  # fmt: skip
        if isinstance(draft, TreeDraft):
            trees += 1
            assert draft.tree == SHAPE
            assert draft.tokens == reference_tree(functools.partial(logits_ref, ctx), to_target)  # fmt: skip
        else:
            assert draft == chain_ref(ctx, len(draft))
    assert trees >= 4
    # Paths off the top-1 chain were accepted (their KV and hidden rows moved into place).
    assert llm.engine.speculator.stats.num_accepted_tokens >= trees

    from llmhal.spec_decode.proposer import DraftRequest

    ctx = list(range(30, 52))
    logged = []
    inner = proposer.logits
    monkeypatch.setattr(proposer, "logits", lambda out: logged.append(inner(out)) or logged[-1])
    request = DraftRequest("by-hand", ctx, [], 3, hidden_want(ctx)[:-1], 0)
    (draft,) = type(proposer).propose(proposer, [request])  # the head's own (not replayed)
    proposer.finish("by-hand")
    # One call per level: the root, then the nodes with children at depths 1 and 2, node order.
    parents = [[0], *[[n for n in range(1, SHAPE.num_nodes + 1) if SHAPE.depths[n] == d and SHAPE.children[n]] for d in (1, 2)]]  # fmt: skip
    assert [len(x) for x in logged] == [len(p) for p in parents]
    for got, nodes in zip(logged, parents, strict=True):
        for row, node in zip(got, nodes, strict=True):
            after = [draft.tokens[a - 1] for a in SHAPE.path(node)]
            torch.testing.assert_close(row, logits_ref(ctx, after), atol=1e-4, rtol=1e-4)


def test_tree_drafts_equal_the_transformers_reference_node_by_node(new_llm, base_llm, head, target, monkeypatch):  # fmt: skip
    # No num_speculative_tokens: the tree's depth (3).
    llm = new_llm({"method": "eagle", "model": head[0], "speculative_token_tree": TREE})
    assert llm.engine.speculator.config.num_speculative_tokens == 3
    hf, ref, fc = target[1], head[1], head[2]

    def hidden(ctx):
        with torch.no_grad():
            return hf.model(torch.tensor([ctx])).last_hidden_state[0]

    check_tree_calls(
        llm, base_llm, monkeypatch, hidden,
        lambda ctx, after: reference_logits(hf, ref, fc, ctx, after),
        lambda ctx, k: reference_drafts(hf, ref, fc, ctx, k),
    )  # fmt: skip


def test_a_tree_rank_past_the_heads_vocabulary_is_refused_before_loading(new_llm, head, target):
    vocab = target[1].config.vocab_size
    spec = {"method": "eagle", "model": head[0], "speculative_token_tree": [[0], [vocab]]}
    with pytest.raises(ValueError, match=f"speculative_token_tree.*rank {vocab}.*{vocab} tokens"):
        new_llm(spec)


def test_tree_greedy_equals_plain_batched_and_preempted(tiny_folder, base_llm, head, monkeypatch):
    # vLLM's spelling: num_speculative_tokens counts the tree's nodes (at least its depth).
    spec = {"method": "eagle", "model": head[0], "num_speculative_tokens": 7, "speculative_token_tree": TREE}  # fmt: skip
    seen = check_batched_and_preempted(tiny_folder, base_llm, spec, monkeypatch, BRANCH)
    assert any(isinstance(c[3], TreeDraft) for per in seen.values() for c in per)


def test_drafts_and_hidden_states_equal_the_transformers_reference(eagle_llm, base_llm, head, target, monkeypatch):  # fmt: skip
    hf = target[1]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain, answers = plain_answers(base_llm, PROMPTS[:2], params)
    seen = record_drafts(eagle_llm, monkeypatch, answers)
    eagle_llm.engine.speculator.reset_stats()
    out = eagle_llm.generate(PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in out] == plain
    assert eagle_llm.engine.speculator.stats.num_accepted_tokens > 0
    calls = [c for per in seen.values() for c in per]
    assert len(calls) >= 4
    assert sum(len(c[3]) for c in calls) >= 2 * len(calls)  # the head drafted
    for ctx, start, hidden, drafts in calls:
        with torch.no_grad():  # the rows handed over are the target's, for start .. n - 2
            want = hf.model(torch.tensor([ctx])).last_hidden_state[0, start : len(ctx) - 1]
        torch.testing.assert_close(hidden, want, atol=1e-4, rtol=1e-4)
        assert drafts == reference_drafts(hf, head[1], head[2], ctx, len(drafts))
    assert [s for _, s, _, _ in next(iter(seen.values()))][:2] == [0, 7]  # whole prompt, then new


def test_greedy_output_equals_plain_decoding_batched(eagle_llm, base_llm):
    plain, _ = plain_answers(base_llm, PROMPTS, GREEDY)
    # With a plain request in the same batches (its max_tokens of 1 leaves no room for drafts).
    mixed = [*PROMPTS, {"prompt_token_ids": [9, 10]}]
    params = [GREEDY] * 3 + [SamplingParams(temperature=0, max_tokens=1)]
    eagle_llm.engine.speculator.reset_stats()
    spec = eagle_llm.generate(mixed, params)
    assert [o.outputs[0].token_ids for o in spec[:3]] == plain
    stats = eagle_llm.engine.speculator.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    assert eagle_llm.engine.speculator.proposer.memory_bytes() > 0


def test_steps_without_drafting_requests_run_recorded_and_drafting_resumes_exactly(new_llm, head, base_llm, target):  # fmt: skip
    # Three requests with disable_by_batch_size=2: nobody drafts (and the target keeps no hidden
    # states, so its decode steps can replay recorded ones) until two have ended; the last one then
    # drafts with a head that starts over from there. Output equals plain decoding throughout.
    spec = {"method": "eagle", "model": head[0], "num_speculative_tokens": 3, "disable_by_batch_size": 2}  # fmt: skip
    llm = new_llm(spec)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 8, 24)]
    plain = [o.outputs[0].token_ids for o in base_llm.generate(PROMPTS, params)]
    spec_out = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in spec_out] == plain
    assert llm.engine.speculator.stats.num_drafts > 0
    graphs = llm.engine.runner.decode_graphs
    if graphs is not None and graphs.refused is None:
        assert graphs.replays > 0


def test_preemption_chunked_prefill_and_prefix_caching(new_llm, head, base_llm, target, monkeypatch):  # fmt: skip
    spec = {"method": "eagle", "model": head[0], "num_speculative_tokens": 3}
    per_block = base_llm.engine.runner.kv_cache_bytes_per_block()
    small = new_llm(spec, kv_cache_memory_bytes=6 * per_block, max_num_batched_tokens=12, max_num_seqs=3)  # fmt: skip
    prompts = PROMPTS + PROMPTS[:2]  # the repeats find the first copies' blocks cached
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain, answers = plain_answers(base_llm, prompts, params)
    seen = record_drafts(small, monkeypatch, answers)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params)] == plain
    assert small.engine.stats.preemptions > 0
    assert small.engine.stats.cached_prompt_tokens > 0
    assert small.engine.speculator.stats.num_accepted_tokens > 0
    # A cached prefix or a recomputation after preemption hands over rows from where the target
    # computed, and the head starts over there.
    assert any(start > 0 for per in seen.values() for _, start, _, _ in per[:1])
    assert not small.engine.speculator._hidden  # nothing kept for finished requests
    assert not small.engine.speculator.proposer._seqs
    for ctx, start, hidden, _ in (c for per in seen.values() for c in per):
        with torch.no_grad():
            want = target[1].model(torch.tensor([ctx])).last_hidden_state[0, start : len(ctx) - 1]
        torch.testing.assert_close(hidden, want, atol=1e-4, rtol=1e-4)


def test_a_head_that_does_not_fit_is_refused_before_loading(tmp_path, new_llm, target):
    wide = tmp_path / "wide"
    make_eagle_head(wide, target[1].config, hidden_size=96, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"hidden_size=96.*target's hidden_size is 64.*published for this target"):  # fmt: skip
        new_llm({"method": "eagle", "model": str(wide), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="needs 'model'"):
        new_llm({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="no config.json"):
        new_llm({"method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 2})


@pytest.mark.slow  # ~5 s: 3000 requests
def test_sampled_second_token_keeps_the_target_marginal(new_llm, head, target, monkeypatch):
    """The second token over thousands of sampled requests against the exact marginal (from
    transformers). The head runs on every call; the drafts verified are the marginal's two likeliest
    tokens, so acceptance and rejection both happen often (a random head's are nearly all rejected)."""
    dist = sibling("test_distribution")
    prompt, temp = dist.PROMPT, dist.TEMPERATURE
    hf = target[1]
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double() / temp, -1)
        seqs = torch.tensor([prompt + [t] for t in range(p1.numel())])
        p2 = torch.softmax(hf(seqs).logits[:, -1].double() / temp, -1)
    marginal = p1 @ p2
    top = marginal.topk(2).indices.tolist()
    llm = new_llm({"method": "eagle", "model": head[0], "num_speculative_tokens": 2}, max_num_seqs=128, max_num_batched_tokens=512)  # fmt: skip
    proposer = llm.engine.speculator.proposer
    inner = proposer.propose
    monkeypatch.setattr(proposer, "propose", lambda reqs: [top[: len(d)] for d in inner(reqs)])
    n = 3000
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, SamplingParams(temperature=temp, max_tokens=3, ignore_eos=True))  # fmt: skip
    second = torch.bincount(torch.tensor([o.outputs[0].token_ids[1] for o in outs]), minlength=marginal.numel())  # fmt: skip
    stats = llm.engine.speculator.stats
    assert stats.num_drafts >= n
    assert 0.05 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.95
    assert dist._chi_square_p(second.float(), marginal) > 1e-3
