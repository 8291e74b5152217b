"""Speculative decoding through the engine: greedy output equals plain decoding token for token,
with every engine feature around it (batching beside plain and constrained requests, stop strings
and max_tokens inside an accepted run, logprobs, penalties, n > 1, preemption, prefix caching,
chunked prefill, aborts), and KV written for rejected drafts is never read."""

from __future__ import annotations

import pytest

from llmhal import SamplingParams
from llmhal.structured_output.params import StructuredOutputsParams

PROMPTS = [
    {"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7]},
    {"prompt_token_ids": list(range(30, 70))},
    {"prompt_token_ids": [100, 200, 100, 200, 100]},
    {"prompt_token_ids": [9]},
]


def _ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _texts(outs):
    return [[(c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def answers(base_llm, replay_proposer):
    """The plain greedy continuations, which the replay drafter proposes (mostly right)."""
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for p, out in zip(PROMPTS, base_llm.generate(PROMPTS, sp), strict=True):
        replay_proposer.answers[tuple(p["prompt_token_ids"])] = out.outputs[0].token_ids
    return replay_proposer.answers


def _both(base_llm, spec_llm, params, prompts=PROMPTS):
    return base_llm.generate(prompts, params), spec_llm.generate(prompts, params)


@pytest.mark.parametrize("drafter", ["ngram_llm", "random_llm", "replay_llm"])
def test_greedy_output_equals_plain_decoding(request, answers, base_llm, drafter):
    spec_llm = request.getfixturevalue(drafter)
    before = spec_llm.engine.speculator.stats.num_drafts
    plain, spec = _both(base_llm, spec_llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))  # fmt: skip
    assert _ids(spec) == _ids(plain)
    assert _texts(spec) == _texts(plain)
    stats = spec_llm.engine.speculator.stats
    assert stats.num_drafts > before
    if drafter == "replay_llm":  # mostly right drafts: long accepted runs were exercised
        assert stats.mean_acceptance_length > 2.5
        graphs = spec_llm.engine.runner.decode_graphs
        if graphs is not None and graphs.refused is None:  # verification steps were recorded too
            assert any(max(qs) > 1 for qs in graphs.recorded_shapes())
    kv = spec_llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks  # every block came back


def test_stop_string_and_max_tokens_inside_an_accepted_run(answers, base_llm, replay_llm):
    tok = base_llm.get_tokenizer()
    ids = answers[tuple(PROMPTS[1]["prompt_token_ids"])]
    stop = tok.decode(ids[6:8])
    for params in (
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
        SamplingParams(
            temperature=0,
            max_tokens=30,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),  # fmt: skip
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[ids[9]]),
    ):
        plain, spec = _both(base_llm, replay_llm, params)
        assert _ids(spec) == _ids(plain)
        assert _texts(spec) == _texts(plain)


def test_logprobs_and_prompt_logprobs_match(answers, base_llm, replay_llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3, prompt_logprobs=2)  # fmt: skip
    plain, spec = _both(base_llm, replay_llm, params)
    assert _ids(spec) == _ids(plain)
    for a, b in zip(plain, spec, strict=True):
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert set(lp_a) == set(lp_b)
            for t in lp_a:
                assert lp_b[t].logprob == pytest.approx(lp_a[t].logprob, abs=1e-4)
                assert lp_b[t].rank == lp_a[t].rank
                assert lp_b[t].decoded_token == lp_a[t].decoded_token
        assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=1e-3)  # fmt: skip
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs)


def test_penalties_min_tokens_and_bad_words_see_the_drafts_as_history(answers, base_llm, ngram_llm, replay_llm):  # fmt: skip
    params = SamplingParams(
        temperature=0, max_tokens=30, min_tokens=8, repetition_penalty=1.4, frequency_penalty=0.3,
        presence_penalty=0.2, bad_words=["a"],
    )  # fmt: skip
    for spec_llm in (ngram_llm, replay_llm):
        plain, spec = _both(base_llm, spec_llm, params)
        assert _ids(spec) == _ids(plain)


def test_beside_plain_constrained_and_n_requests(answers, base_llm, replay_llm):
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(
            temperature=0,
            max_tokens=24,
            structured_outputs=StructuredOutputsParams(regex="[ab]{3,9}"),
        ),  # fmt: skip
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=3),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    ]
    plain = base_llm.generate(PROMPTS, params)
    spec = replay_llm.generate(PROMPTS, params)
    assert _ids(spec) == _ids(plain)
    assert len(spec[2].outputs) == 3


def test_sampled_requests_run_with_seeds_and_n(replay_llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True, n=2, seed=3)  # fmt: skip
    a = replay_llm.generate(PROMPTS, params)
    b = replay_llm.generate(PROMPTS, params)
    assert _ids(a) == _ids(b)  # a seeded request draws its own numbers, batch or not
    assert all(len(c.token_ids) == 20 for o in a for c in o.outputs)


def test_preemption_chunked_prefill_and_prefix_caching(new_llm, answers, base_llm):
    """A cache of a few blocks (requests preempted and recomputed), a step budget smaller than
    the drafts and prompts (chunked prefill, drafts trimmed), and repeated prompts (cached)."""
    spec = {"method": "test_replay", "num_speculative_tokens": 4}
    per_block = base_llm.engine.runner.kv_cache_bytes_per_block()
    # 8 blocks of 16: the longest request alone needs 5.
    small = new_llm(spec, kv_cache_memory_bytes=8 * per_block, max_num_batched_tokens=12, max_num_seqs=4)  # fmt: skip
    prompts = PROMPTS + PROMPTS  # the second copies find the first's blocks cached
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert _ids(small.generate(prompts, params)) == _ids(base_llm.generate(prompts, params))
    assert small.engine.stats.preemptions > 0
    assert small.engine.stats.cached_prompt_tokens > 0
    assert small.engine.speculator.stats.num_accepted_tokens > 0
    assert small.engine.kv.num_free_blocks == small.engine.kv.num_blocks


def test_abort_in_the_middle_frees_everything(answers, replay_llm):
    engine = replay_llm.engine
    rid = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))  # fmt: skip
    for _ in range(4):
        engine.step()
    req = engine._requests[rid]
    assert req.spec_token_ids  # drafts were waiting for their verification
    engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert rid not in engine.speculator.adaptive._requests


def test_adaptive_switch_stops_a_request_whose_drafts_fail(new_llm, base_llm):
    spec = {"method": "test_random", "num_speculative_tokens": 2, "disable_below_acceptance_rate": 0.5, "min_drafts_before_disable": 3}  # fmt: skip
    llm = new_llm(spec)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert _ids(llm.generate(PROMPTS[:1], params)) == _ids(base_llm.generate(PROMPTS[:1], params))
    # Then it decoded one token per step: the default retry (32 steps) lies past max_tokens.
    assert llm.engine.speculator.stats.num_drafts == 3


def test_a_stopped_request_drafts_again_after_its_wait(new_llm, base_llm):
    # Random drafts fail every window of 3, one token a step. Token 1 (prefill), drafts 1-3
    # (tokens 2-4), stopped: waits 4 steps (5-8), drafts 4-6 (9-11), waits 8 (the wait doubles;
    # 12-19), drafts 7-9 (20-22), waits 16 (23-38): 9 drafts in 38 tokens.
    spec = {"method": "test_random", "num_speculative_tokens": 2, "disable_below_acceptance_rate": 0.5, "min_drafts_before_disable": 3, "retry_after_steps": 4}  # fmt: skip
    llm = new_llm(spec)
    params = SamplingParams(temperature=0, max_tokens=38, ignore_eos=True)
    assert _ids(llm.generate(PROMPTS[:1], params)) == _ids(base_llm.generate(PROMPTS[:1], params))
    assert llm.engine.speculator.stats.num_drafts == 9


CONSTRAINTS = [
    StructuredOutputsParams(regex="(ab|ba){2,6}c"),
    StructuredOutputsParams(
        json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    ),  # fmt: skip
    StructuredOutputsParams(choice=["alpha beta gamma", "alpha beta delta", "omega"]),
]


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=["regex", "json", "choice"])
def test_structured_outputs_speculate_within_the_grammar(base_llm, replay_llm, random_llm, answers, constraint):  # fmt: skip
    """Drafts the grammar refuses are cut before verification, each verified position is masked
    as after the drafts before it, and the grammar ends up where plain decoding leaves it."""
    prompts = [{"prompt_token_ids": [11, 12, 13]}, {"prompt_token_ids": [40, 41]}]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint)
    plain = base_llm.generate(prompts, params)
    for p, out in zip(prompts, plain, strict=True):
        answers[tuple(p["prompt_token_ids"])] = out.outputs[0].token_ids
    before = replay_llm.engine.speculator.stats.num_accepted_tokens
    for spec_llm in (replay_llm, random_llm):
        spec = spec_llm.generate(prompts, params)
        assert _ids(spec) == _ids(plain)
        assert _texts(spec) == _texts(plain)
    if max(len(o.outputs[0].token_ids) for o in plain) > 2:  # room for drafts: some were accepted
        assert replay_llm.engine.speculator.stats.num_accepted_tokens > before
