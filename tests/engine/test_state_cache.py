"""The state cache's bookkeeping (no model): how one budget splits between state slots and KV
blocks, and how slots follow requests through admission, preemption, abort and completion."""

from __future__ import annotations

import pytest

from llmhal.engine.request import RequestStatus
from llmhal.engine.scheduler import Scheduler
from llmhal.engine.state_cache import StateCacheManager, make_cache_manager, plan_caches
from tests.engine.test_scheduler import req, run_step


# ----------------------------------------------------------------------------- planning
def test_attention_only_budget_goes_to_blocks():
    plan = plan_caches(1000, 100, 0, max_num_seqs=8, max_model_len=64, block_size=16)
    assert (plan.num_blocks, plan.num_slots) == (10, 0)


def test_recurrent_only_needs_no_kv_memory():
    # 10 slots fit, max_num_seqs caps them at 4; blocks are bookkeeping: 4 full contexts.
    plan = plan_caches(1000, 0, 100, max_num_seqs=4, max_model_len=64, block_size=16)
    assert (plan.num_slots, plan.num_blocks) == (4, 16)
    assert "no KV cache" in plan.note


def test_hybrid_states_take_at_most_half_the_budget():
    plan = plan_caches(10_000, 100, 1000, max_num_seqs=64, max_model_len=64, block_size=16)
    assert plan.num_slots == 5 and plan.num_blocks == 50  # 5000 bytes of states, the rest blocks


def test_a_budget_below_one_state_names_the_remedy():
    with pytest.raises(ValueError, match="recurrent state of one sequence.*kv_cache_memory_bytes"):
        plan_caches(99, 0, 100, max_num_seqs=4, max_model_len=64, block_size=16)


# ------------------------------------------------------------------------------- slots
def test_slots_are_taken_on_admission_and_come_back_on_finish():
    kv = StateCacheManager(num_blocks=64, block_size=4, num_slots=2)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = req("a", 3), req("b", 5), req("c", 2)
    for r in (a, b, c):
        s.add(r)
    first = run_step(s)
    # Two slots: c waits, although blocks, budget and max_num_seqs would admit it.
    assert [r.request_id for r, _ in first.items] == ["a", "b"]
    assert sorted([kv.slot_of(a), kv.slot_of(b)]) == [0, 1]
    freed = kv.slot_of(a)
    assert kv.num_free_slots == 0
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    assert kv.num_free_slots == 1
    second = run_step(s)
    assert [r.request_id for r, _ in second.items] == ["b", "c"]
    assert kv.slot_of(c) == freed
    s.finish(b, RequestStatus.FINISHED_ABORTED)  # an abort frees it the same way
    s.finish(c, RequestStatus.FINISHED_STOPPED)
    assert kv.num_free_slots == 2 and kv.num_free_blocks == 64


def test_a_slot_is_not_held_when_blocks_are_short():
    kv = StateCacheManager(num_blocks=1, block_size=4, num_slots=2)
    r = req("big", 9)  # needs 3 blocks
    assert not kv.allocate(r, 9)
    assert kv.num_free_slots == 2
    with pytest.raises(RuntimeError, match="holds no state slot"):
        kv.slot_of(r)


def test_preemption_frees_the_slot_and_readmission_starts_fresh():
    kv = StateCacheManager(num_blocks=4, block_size=4, num_slots=2)
    s = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    a, b = req("a", 8), req("b", 8)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefill (2 blocks each): the pool is full
    batch = run_step(s)  # a's decode needs a third block: b, the latest admitted, gives way
    assert batch.preempted == [b] and b.num_computed_tokens == 0
    assert kv.num_free_slots == 1
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    run_step(s)
    assert b.status is RequestStatus.RUNNING and b.num_computed_tokens == 9  # recomputed
    assert kv.num_free_slots == 1


def test_prefix_caching_is_refused_and_attention_models_keep_the_plain_manager():
    with pytest.raises(ValueError, match="prefix caching"):
        StateCacheManager(8, 4, 2, enable_prefix_caching=True)
    plain = make_cache_manager(8, 4, 0, True)
    assert type(plain).__name__ == "KVCacheManager" and plain.enable_prefix_caching
    assert isinstance(make_cache_manager(8, 4, 2, False), StateCacheManager)
