"""Pipeline parallelism with more than one batch in flight (issue 24): while the last stage works
on batch k, rank 0 runs the first stage of batch k + 1, made of requests not in flight. Output
stays token for token that of one process; aborts, preemption and a dying worker still behave.

Overlap is proven by the engine's batch-queue counters (batches submitted while another was in
flight), never by timing."""

from __future__ import annotations

import pytest

from llmhal import LLM, SamplingParams
from llmhal.engine.batch_queue import BatchQueue
from llmhal.engine.kv_cache_manager import KVCacheManager
from llmhal.engine.request import Request
from llmhal.engine.scheduler import Scheduler

KV = 4 << 20
PROMPTS = [
    "The capital of France is", "def add(a, b):", "1, 2, 3, 4,", "Once upon a time",
    "The quick brown fox", "import numpy as", "Dear Sir or Madam,", "SELECT * FROM",
]  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


LONG = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=6, prompt_logprobs=2)


def ids(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def seeded(llm: LLM) -> tuple[list[list[int]], list]:
    """Seeded samples and rounded prompt log-probabilities of the first four prompts."""
    outs = llm.generate(PROMPTS[:4], SEEDED, use_tqdm=False)
    lps = [[sorted((t, round(lp.logprob, 4)) for t, lp in e.items()) for e in o.prompt_logprobs[1:]] for o in outs]  # fmt: skip
    return [o.outputs[0].token_ids for o in outs], lps


@pytest.fixture(scope="module")
def want(tiny_models):
    """A tiny Llama's folder and one process's answers (that engine stopped before the pipeline's
    starts: a process holds one multi-rank engine)."""
    folder = tiny_models("llama")[0]
    llm = LLM(folder, kv_cache_memory_bytes=KV)
    try:
        return {
            "folder": folder,
            "greedy": ids(llm), "greedy3": ids(llm, PROMPTS[:3]), "greedy4": ids(llm, PROMPTS[:4]),
            "long": ids(llm, PROMPTS[:6], LONG), "seeded": seeded(llm),
            "block_bytes": llm.engine.runner.kv_cache_bytes_per_block(),
        }  # fmt: skip
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def pp2(want):
    """Two stages, their KV caches 20 blocks of 16 tokens (half the layers each, so half the
    bytes per block): room for the 8 short requests (2 blocks each), not for 6 long ones (5)."""
    tight = want["block_bytes"] // 2 * 20
    llm = LLM(want["folder"], kv_cache_memory_bytes=tight, pipeline_parallel_size=2)
    yield llm
    llm.shutdown()


def test_pp2_with_batches_in_flight_equals_one_process(pp2, want):
    engine = pp2.engine
    assert engine.executor.max_concurrent_batches == 2
    got = ids(pp2)
    queue = engine._batch_queue
    # Two batches were in the pipeline at once, many times over (8 requests, 4 per batch).
    assert queue.most_in_flight == 2 and queue.overlapped >= GREEDY.max_tokens, vars(queue)
    assert not queue.pending and not queue.busy
    assert got == want["greedy"]


def test_pp2_one_batch_at_a_time_still_equals_one_process(pp2, want):
    """max_concurrent_batches = 1 (the benchmark's baseline): the engine waits for each step."""
    engine = pp2.engine
    engine.executor.max_concurrent_batches = 1
    try:
        before = engine._batch_queue.overlapped if engine._batch_queue else 0
        got = ids(pp2, PROMPTS[:3])
        after = engine._batch_queue.overlapped if engine._batch_queue else 0
    finally:
        engine.executor.max_concurrent_batches = 2
    assert after == before
    assert got == want["greedy3"]


def test_going_to_one_batch_with_a_batch_in_flight_still_collects_it(pp2, want):
    engine = pp2.engine
    rids = [engine.add_request(p, GREEDY) for p in PROMPTS[:4]]
    engine.step()  # a batch in flight
    engine.executor.max_concurrent_batches = 1
    outputs: dict[str, list[int]] = {}
    try:
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)  # fmt: skip
    finally:
        engine.executor.max_concurrent_batches = 2
    assert [outputs[r] for r in rids] == want["greedy4"]


def test_prompt_logprobs_and_seeded_sampling_with_batches_in_flight(pp2, want):
    assert seeded(pp2) == want["seeded"]


def test_abort_while_its_batch_is_in_flight(pp2, want):
    """A request aborted while its batch is in the pipeline: its output is dropped when the batch
    comes back, and the other requests go on unchanged."""
    engine = pp2.engine
    rids = [engine.add_request(p, GREEDY) for p in PROMPTS[:4]]
    engine.step()  # batch 1 submitted (2 requests); the next step submits batch 2
    queue = engine._batch_queue
    assert len(queue.pending) == 1
    victim = sorted(queue.busy)[0]
    engine.abort_request(victim)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != victim
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    assert sorted(outputs) == sorted(r for r in rids if r != victim)
    assert not queue.pending and not queue.busy
    expected = dict(zip(rids, want["greedy4"], strict=True))
    assert outputs == {r: expected[r] for r in outputs}


def test_preemption_with_batches_in_flight_equals_one_process(pp2, want):
    """Requests preempted and recomputed (never one whose batch is in flight) while batches are
    in flight: the tokens stay those of one process."""
    before = pp2.engine.scheduler.num_preemptions
    got = ids(pp2, PROMPTS[:6], LONG)
    assert pp2.engine.scheduler.num_preemptions > before
    assert got == want["long"]


class _Detok:
    text = ""


def _req(rid: str, prompt_len: int) -> Request:
    return Request(rid, None, list(range(prompt_len)), SamplingParams(), 100, frozenset(), _Detok())  # type: ignore[arg-type]  # fmt: skip


def test_scheduler_skips_busy_requests_caps_the_batch_and_never_preempts_the_busy():
    """The scheduler's side (no model): requests in flight are skipped and never chosen to give
    way when blocks run out; ``max_reqs`` caps the batch."""
    kv = KVCacheManager(num_blocks=5, block_size=4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    reqs = [_req(r, 4) for r in "abcd"]
    for r in reqs:
        s.add(r)
    first = s.schedule(max_reqs=2)
    assert [r.request_id for r, _ in first.items] == ["a", "b"]
    busy = frozenset({"a", "b"})
    second = s.schedule(busy, max_reqs=2)
    assert [r.request_id for r, _ in second.items] == ["c", "d"]
    for r, n in [*first.items, *second.items]:  # every prompt computed, a token sampled
        r.num_computed_tokens += n
        r.output_token_ids.append(1)
    # c and d are in flight now. a and b each need a second block for their next token and one
    # is left: a takes it, and b gives way, not d (the latest admitted, but busy).
    third = s.schedule(frozenset({"c", "d"}), max_reqs=2)
    assert [r.request_id for r, _ in third.items] == ["a"]
    assert [r.request_id for r in third.preempted] == ["b"]
    assert {r.request_id for r in s.running} == {"a", "c", "d"}


def test_share_splits_the_running_requests_among_the_batches():
    class Sched:
        running = [object()] * 5
        waiting = [object()] * 2

    assert BatchQueue().share(Sched, 2) == 4
    assert BatchQueue().share(Sched, 8) == 1
    Sched.running, Sched.waiting = [], []
    assert BatchQueue().share(Sched, 2) == 1
