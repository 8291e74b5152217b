"""Prefix caching: the block pool's bookkeeping with stand-in requests, then the engine on a tiny
model, where a cached prefix must change nothing but the work done."""

from __future__ import annotations

import pytest

from llmhal import LLM, SamplingParams
from llmhal.engine.kv_cache_manager import KVCacheManager, block_hash
from llmhal.engine.request import Request, RequestStatus
from llmhal.engine.scheduler import Scheduler


class _Detok:
    text = ""


def req(
    rid: str, tokens: list[int], salt: str | None = None, prompt_logprobs: bool = False
) -> Request:
    r = Request(rid, None, list(tokens), SamplingParams(), 100, frozenset(), _Detok())  # type: ignore[arg-type]
    r.cache_salt = salt
    if prompt_logprobs:
        r.prompt_logprobs = [None]
    return r


def admit(kv: KVCacheManager, r: Request) -> int:
    """Admit ``r`` as the scheduler does and compute all its tokens; returns the tokens it found
    cached."""
    prefix = kv.cached_prefix(r)
    n = r.num_tokens - len(prefix) * kv.block_size
    assert kv.allocate(r, n, prefix)
    kv.record_lookup(r, len(prefix))
    r.num_computed_tokens += n
    kv.cache_blocks(r)
    return len(prefix) * kv.block_size


def cached_kv(num_blocks: int = 16) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=4, enable_prefix_caching=True)


def test_a_shared_prefix_reuses_the_blocks_and_only_the_rest_is_computed():
    kv = cached_kv()
    a = req("a", list(range(10)))
    assert admit(kv, a) == 0
    b = req("b", list(range(8)) + [50, 51, 52])
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    s.add(b)
    batch = s.schedule()
    # b's first two blocks are a's; it computes its last 3 tokens only.
    assert [(r.request_id, n) for r, n in batch.items] == [("b", 3)]
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] not in a.block_ids
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    stats = kv.take_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 21, 8)
    assert kv.take_stats().queries == 0  # taken: the next report starts from zero


def test_the_last_token_is_always_computed():
    kv = cached_kv()
    admit(kv, req("a", list(range(8))))  # two full blocks
    # The same 8 tokens again: the second block would leave nothing to compute, so only the first
    # is reused and the last 4 tokens (the second block) are computed into a block of its own.
    assert admit(kv, b := req("b", list(range(8)))) == 4
    assert len(set(b.block_ids)) == 2


def test_blocks_are_shared_until_the_last_holder_frees_them():
    kv = cached_kv(num_blocks=4)
    a, b = req("a", list(range(9))), req("b", list(range(9)))
    admit(kv, a)
    admit(kv, b)
    assert b.block_ids[:2] == a.block_ids[:2]
    free_before = kv.num_free_blocks
    kv.free(a)
    assert kv.num_free_blocks == free_before + 1  # only a's own third block came back
    kv.free(b)
    assert kv.num_free_blocks == 4


def test_freed_blocks_stay_cached_and_are_evicted_last_and_tail_first():
    kv = cached_kv(num_blocks=4)
    a = req("a", list(range(12)))
    admit(kv, a)  # 3 blocks, all full, all registered
    kv.free(a)
    # One uncached block is left: a newcomer takes it before any cached one.
    c = req("c", [90, 91, 92])
    admit(kv, c)
    assert kv.cached_prefix(req("a2", list(range(12)) + [7])) != []
    kv.free(c)
    # Needing 2 blocks more than the plain one: a's tail block goes first, then its middle one;
    # its first block is still there.
    d = req("d", list(range(100, 111)))
    admit(kv, d)
    again = req("a3", list(range(12)) + [7])
    assert len(kv.cached_prefix(again)) == 1


def test_a_failed_admission_changes_nothing():
    kv = cached_kv(num_blocks=3)
    a = req("a", list(range(8)))
    admit(kv, a)
    kv.free(a)  # 2 cached blocks free, 1 plain
    b = req("b", list(range(8)) + list(range(50, 60)))  # reuses 2 blocks, needs 3 more: short
    prefix = kv.cached_prefix(b)
    assert len(prefix) == 2
    assert not kv.allocate(b, b.num_tokens - 8, prefix)
    assert b.block_ids == [] and b.num_computed_tokens == 0 and kv.num_free_blocks == 3
    assert len(kv.cached_prefix(req("c", list(range(8)) + [1]))) == 2  # still cached


def test_requests_with_different_salts_never_share():
    kv = cached_kv()
    admit(kv, req("a", list(range(12)), salt="alice"))
    assert admit(kv, req("b", list(range(12)), salt="bob")) == 0
    assert admit(kv, req("c", list(range(12)))) == 0
    assert admit(kv, req("d", list(range(12)), salt="alice")) == 8
    assert block_hash(None, [1, 2], "x") != block_hash(None, [1, 2], None)


def test_a_block_hash_covers_every_token_before_it():
    first = block_hash(None, [1, 2, 3, 4])
    assert block_hash(first, [5, 6, 7, 8]) != block_hash(
        block_hash(None, [1, 2, 3, 9]), [5, 6, 7, 8]
    )
    assert block_hash(first, [5, 6, 7, 8]) == block_hash(
        block_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8]
    )


def test_prompt_logprobs_reuse_only_the_positions_already_scored():
    kv = cached_kv()
    admit(kv, req("a", list(range(12))))
    fresh = req("b", list(range(12)), prompt_logprobs=True)
    assert kv.cached_prefix(fresh) == []  # needs every position's logits
    fresh.prompt_logprobs = [None] + [{}] * 5  # positions 0..4 scored (as after a preemption)
    assert len(kv.cached_prefix(fresh)) == 1  # 5 // 4


def test_a_preempted_request_finds_its_own_blocks():
    kv = cached_kv(num_blocks=4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = req("a", list(range(8))), req("b", list(range(20, 28)))
    s.add(a)
    s.add(b)
    for r, n in s.schedule().items:  # each computes its 8 tokens: 2 full blocks each
        r.num_computed_tokens += n
        kv.cache_blocks(r)
        r.output_token_ids.append(1)
    batch = s.schedule()  # a needs a 3rd block: b, the latest, is preempted
    assert batch.preempted == [b]
    for r, n in batch.items:
        r.num_computed_tokens += n
        kv.cache_blocks(r)
    s.finish(a, a.status)
    batch = s.schedule()
    # b comes back with its first block cached (its 9 tokens keep the last one to compute).
    assert [(r.request_id, n) for r, n in batch.items] == [("b", 5)] and b.num_computed_tokens == 4


def test_a_readmission_after_preemption_is_not_counted_again():
    kv = cached_kv()
    admit(kv, a := req("a", list(range(12))))
    assert kv.take_stats().queries == 12
    kv.free(a)
    a.num_computed_tokens = 0  # as Scheduler._preempt leaves it
    a.output_token_ids.append(1)
    assert admit(kv, a) == 12  # its own blocks, found again
    assert kv.take_stats().queries == 0 and a.num_cached_tokens == 0
    # A request that must score every prompt position reads nothing and is not counted either.
    admit(kv, req("p", list(range(12)), prompt_logprobs=True))
    assert kv.take_stats().queries == 0


def _step(s: Scheduler, kv: KVCacheManager) -> list[tuple[str, int]]:
    """One scheduler step with every scheduled token computed (a stand-in model emits token 1)."""
    batch = s.schedule()
    for r, n in batch.items:
        r.num_computed_tokens += n
        kv.cache_blocks(r)
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(1)
    return [(r.request_id, n) for r, n in batch.items]


def test_a_request_waits_for_the_blocks_another_is_computing():
    kv = cached_kv(num_blocks=32)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = req("a", list(range(20))), req("b", list(range(16)) + [90, 91, 92])
    c = req("c", [50, 51, 52, 53, 54])  # unrelated, behind b
    for r in (a, b, c):
        s.add(r)
    # b's leading 4 blocks are a's, being computed: b waits, and c goes ahead of it ...
    assert _step(s, kv) == [("a", 20), ("c", 5)]
    assert list(s.waiting) == [b]
    # ... then b takes them cached and computes its last 3 tokens only.
    assert _step(s, kv) == [("a", 1), ("c", 1), ("b", 3)]
    assert b.num_cached_tokens == 16 and b.block_ids[:4] == a.block_ids[:4]


def test_a_short_shared_opening_is_not_worth_waiting_for():
    kv = cached_kv(num_blocks=32)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = req("a", list(range(20))), req("b", list(range(4)) + list(range(60, 76)))
    s.add(a)
    s.add(b)
    # One shared block of 4 out of 20 tokens: both are computed in the same step.
    assert _step(s, kv) == [("a", 20), ("b", 20)]


@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_always_progresses_and_reads_only_its_own_tokens(seed):
    """Shared prefixes, n > 1 copies, salts, chunked prefill, preemption and aborts: every step
    runs something, every request finishes, every cached position a request reads was computed
    from that request's own tokens, and every block comes back."""
    import random

    rng = random.Random(seed)
    bs, num_blocks = rng.choice([1, 2, 4]), rng.randint(12, 40)
    kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=True)
    chunked = seed % 3 != 0
    max_len = num_blocks * bs // 2
    s = Scheduler(kv, rng.randint(1, 6), rng.randint(1, 40) if chunked else max_len + 8, chunked)
    stems = [[rng.randint(0, 3) for _ in range(rng.randint(1, max_len - 2))] for _ in range(3)]
    written: dict[tuple[int, int], tuple] = {}  # (block, slot) -> (salt, tokens up to it)
    live: list[Request] = []
    for i in range(40):
        stem = rng.choice(stems)
        tokens = (stem[: rng.randint(0, len(stem))] + [rng.randint(0, 3)] * rng.randint(1, 4))[: max_len - 2]  # fmt: skip
        for j in range(rng.choice([1, 1, 2, 3])):
            r = req(f"{i}.{j}", tokens, salt=rng.choice([None, None, "s"]))
            r.max_tokens = rng.randint(1, max_len - len(tokens))
            s.add(r)
            live.append(r)
    steps = 0
    while s.has_unfinished():
        steps += 1
        assert steps < 5000
        if rng.random() < 0.03:
            s.finish(victim := rng.choice(live), RequestStatus.FINISHED_ABORTED)
            live.remove(victim)
            continue
        batch = s.schedule()
        assert batch, "a step with requests left must run something"
        for r, n in batch.items:
            toks = r.prompt_token_ids + r.output_token_ids
            seen = [(r.cache_salt, tuple(toks[: p + 1])) for p in range(len(toks))]
            for p in range(r.num_computed_tokens):
                assert written[(r.block_ids[p // bs], p % bs)] == seen[p]
            for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
                written[(r.block_ids[p // bs], p % bs)] = seen[p]
            r.num_computed_tokens += n
            kv.cache_blocks(r)
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(rng.randint(0, 3))
                if len(r.output_token_ids) >= r.max_tokens:
                    s.finish(r, RequestStatus.FINISHED_LENGTH)
                    live.remove(r)
    assert not live and kv.num_free_blocks == num_blocks


def test_reset_waits_for_running_requests_and_off_means_off():
    kv = cached_kv()
    admit(kv, a := req("a", list(range(12))))
    assert kv.reset_prefix_cache() is False  # a still holds its blocks: nothing forgotten
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert admit(kv, req("b", list(range(12)))) == 0
    off = KVCacheManager(16, 4)
    admit(off, req("a", list(range(12))))
    assert admit(off, req("b", list(range(12)))) == 0 and off.take_stats() is None


# --------------------------------------------------------------------------- engine
SYSTEM = [5, 17, 3, 99, 42, 7, 7, 64, 12, 5, 88, 31, 2, 19, 50, 6, 6, 73, 21, 9, 11, 13, 40, 41]
PROMPTS = [SYSTEM + [60, 61, 62], SYSTEM + [70], SYSTEM + [80, 81, 82, 83, 84, 85]]


def _llm(folder: str, **kw) -> LLM:
    return LLM(folder, dtype="float32", max_model_len=128, block_size=4, **kw)


def _run(llm: LLM, params: SamplingParams, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outs, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def folder(tiny_models):
    return tiny_models("llama")[0]


@pytest.fixture(scope="module")
def reference(folder):
    """Greedy and seeded outputs with prefix caching off."""
    llm = _llm(folder, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    return {"greedy": _run(llm, greedy), "seeded": _run(llm, seeded)[1], "params": (greedy, seeded)}


def test_cached_prefixes_change_no_output(folder, reference):
    greedy, seeded = reference["params"]
    llm = _llm(folder)
    first, tokens = _run(llm, greedy)
    assert tokens == reference["greedy"][1]
    second, again = _run(llm, greedy)  # every prompt's leading blocks are cached now
    assert again == reference["greedy"][1]
    assert [o.num_cached_tokens for o in second] == [24, 24, 28]
    for out, ref in zip(second, reference["greedy"][0], strict=True):
        for got, want in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            assert set(got) == set(want)
            for t in got:
                assert got[t].logprob == pytest.approx(want[t].logprob, abs=1e-4)
    assert _run(llm, seeded)[1] == reference["seeded"]


def test_preemption_with_a_cached_prefix_changes_no_output(folder, reference):
    greedy, _ = reference["params"]
    # 12 blocks of 4 tokens: the three requests (up to 42 tokens each) cannot all stay.
    llm = _llm(folder, kv_cache_memory_bytes=12 * _block_bytes(folder))
    outs, tokens = _run(llm, greedy)
    assert tokens == reference["greedy"][1]
    assert llm.engine.stats.preemptions > 0


def _block_bytes(folder: str) -> int:
    probe = _llm(folder, enable_prefix_caching=False)
    return probe.engine.runner.kv_cache_bytes_per_block()


def test_prompt_logprobs_are_unchanged_by_a_cached_prefix(folder):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    off = _run(_llm(folder, enable_prefix_caching=False), params)[0]
    llm = _llm(folder)
    _run(llm, SamplingParams(temperature=0, max_tokens=1))  # caches the prompts' blocks
    on = _run(llm, params)[0]
    assert [o.num_cached_tokens for o in on] == [0, 0, 0]  # fresh prompt log-probs need every row
    for a, b in zip(on, off, strict=True):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert {t: round(v.logprob, 4) for t, v in x.items()} == pytest.approx(
                {t: round(v.logprob, 4) for t, v in y.items()}, abs=2e-4
            )


def test_parallel_samples_compute_their_prompt_once(folder):
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    off = _llm(folder, enable_prefix_caching=False)
    llm = _llm(folder)
    want = [c.token_ids for c in off.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0].outputs]  # fmt: skip
    llm.engine.stats.__init__()
    got = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0]
    assert [c.token_ids for c in got.outputs] == want
    # 30 prompt tokens: the first child computes them all, the other three find 28 cached.
    stats = llm.engine.stats
    assert (stats.prefill_tokens, stats.cached_prompt_tokens) == (30 + 3 * 2, 3 * 28)


def test_cache_salt_and_reset(folder):
    llm = _llm(folder)
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([{"prompt_token_ids": PROMPTS[0], "cache_salt": "a"}], params, use_tqdm=False)
    other = llm.generate(
        [{"prompt_token_ids": PROMPTS[0], "cache_salt": "b"}], params, use_tqdm=False
    )
    same = llm.generate(
        [{"prompt_token_ids": PROMPTS[0], "cache_salt": "a"}], params, use_tqdm=False
    )
    assert (other[0].num_cached_tokens, same[0].num_cached_tokens) == (0, 24)
    assert llm.reset_prefix_cache() is True
    after = llm.generate(
        [{"prompt_token_ids": PROMPTS[0], "cache_salt": "a"}], params, use_tqdm=False
    )
    assert after[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate([{"prompt_token_ids": PROMPTS[0], "cache_salt": ""}], params, use_tqdm=False)


def test_the_server_reports_cached_prompt_tokens_when_asked(folder, server):
    import threading

    from llmhal.entrypoints.serve import build_server
    from llmhal.testing.http_client import post_json

    body = {
        "prompt": [(7 * i + 3) % 200 + 10 for i in range(40)],
        "max_tokens": 1,
        "temperature": 0,
    }
    base, _ = server  # vLLM's default: no details
    assert "prompt_tokens_details" not in post_json(base + "/v1/completions", body)[1]["usage"]
    llm = LLM(folder, dtype="float32", max_model_len=128)
    srv = build_server(llm, "127.0.0.1", 0, model_name="tiny", enable_prompt_tokens_details=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1/completions"
        first = post_json(url, body)[1]["usage"]
        again = post_json(url, body)[1]["usage"]
        streamed = post_json(url, {**body, "stream": True, "stream_options": {"include_usage": True}}, stream=True)[1]  # fmt: skip
        # 40 tokens: the first time nothing is cached, then 2 blocks of 16.
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        assert again["prompt_tokens"] == 40 and again["prompt_tokens_details"] == {
            "cached_tokens": 32
        }
        assert streamed[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    finally:
        srv.shutdown()
        srv.server_close()
        srv.state.loop.shutdown()
