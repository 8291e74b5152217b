"""Decode pace: while requests decode, a step's prompt tokens are limited by measured costs (fed
here as fake step times, no model and no clock), never below a few tokens; a stalled step does not
move the limit; with nothing decoding, and with the pace off, a step fills its budget."""

from __future__ import annotations

import pytest

from llmhal.engine.kv_cache_manager import KVCacheManager
from llmhal.engine.request import Request
from llmhal.engine.sampling_params import SamplingParams
from llmhal.engine.scheduler import Scheduler
from llmhal.engine.step_budget import MIN_PREFILL_TOKENS, OUTLIER_RATIO, DecodePace


class _Detok:
    text = ""


def req(rid: str, prompt_len: int) -> Request:
    return Request(rid, None, list(range(prompt_len)), SamplingParams(), 100, frozenset(), _Detok())  # type: ignore[arg-type]


def run_step(sched: Scheduler) -> list[tuple[str, int]]:
    batch = sched.schedule()
    for r, n in batch.items:
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(1)
    return [(r.request_id, n) for r, n in batch.items]


def measured(factor: float, base_s: float, per_token_s: float) -> DecodePace:
    """A pace that has seen decode-only steps of 1 and 8 tokens and one pure prefill step, timed
    as a machine whose step of n tokens takes ``base_s + per_token_s * n``."""
    pace = DecodePace(factor)
    for d in (1, 8, 1, 8):
        pace.observe(0, d, base_s + d * per_token_s)
    pace.observe(100, 0, base_s + 100 * per_token_s)
    return pace


def decoding_scheduler(pace: DecodePace | None, n_decoding: int, budget: int = 512) -> Scheduler:
    """A scheduler whose ``n_decoding`` requests have their prompts computed and now decode."""
    s = Scheduler(KVCacheManager(num_blocks=512, block_size=4), 64, budget, pace=pace)
    for i in range(n_decoding):
        s.add(req(f"d{i}", 3))
    run_step(s)
    return s


def test_the_cost_model_follows_the_fed_step_times():
    pace = DecodePace(2.0)
    for d in (1, 4, 16, 1, 4, 16):
        pace.observe(0, d, 0.010 + 0.002 * d)  # a fixed cost and a per-token one
    pace.observe(50, 8, 0.010 + 0.002 * 58)  # a mixed step's tokens count alike
    assert pace.line() == pytest.approx((0.010, 0.002))
    assert pace.step_seconds(8) == pytest.approx(0.026)
    # The fixed cost is 5 tokens' worth: 8 decodes take 13 tokens' time, and a factor of 3
    # leaves (3 - 1) x 13 tokens for prompts; 4 decodes at a factor of 2 leave 9, below the floor.
    pace.factor = 3.0
    assert pace.prefill_allowance(8) == 26
    pace.factor = 2.0
    assert pace.prefill_allowance(4) == MIN_PREFILL_TOKENS == 12


def test_prefill_is_capped_while_requests_decode():
    # A fixed cost of 20 tokens' time: 8 decodes leave (2 - 1) x (20 + 8) = 28 prompt tokens.
    pace = measured(2.0, 0.040, 0.002)
    s = decoding_scheduler(pace, 8)
    s.add(req("new", 200))
    step = run_step(s)
    assert step[:8] == [(f"d{i}", 1) for i in range(8)]
    assert step[8:] == [("new", 28)]
    # The prompt continues in capped chunks while the streams decode.
    assert run_step(s)[8:] == [("new", 28)]
    # A factor of 3 doubles the spare time.
    pace.factor = 3.0
    assert run_step(s)[8:] == [("new", 56)]


def test_the_limit_does_not_depend_on_how_fast_the_machine_runs_now():
    # Load on a shared machine scales every step's time; the room for prompts stays the same.
    quick, slow = measured(2.0, 0.040, 0.002), measured(2.0, 0.120, 0.006)
    assert [quick.prefill_allowance(d) for d in (1, 8, 30)] == [slow.prefill_allowance(d) for d in (1, 8, 30)] == [21, 28, 50]  # fmt: skip


def test_a_stalled_step_counts_as_at_most_twice_its_prediction():
    pace, stalled = measured(2.0, 0.040, 0.002), measured(2.0, 0.040, 0.002)
    stalled.observe(16, 8, 5.0)  # descheduled for seconds
    pace.observe(16, 8, OUTLIER_RATIO * pace.step_seconds(24))  # type: ignore[operator]
    assert stalled.line() == pytest.approx(pace.line())


def test_the_cap_covers_every_prompt_of_the_step_together():
    pace = measured(2.0, 0.040, 0.002)
    s = decoding_scheduler(pace, 8)
    for i in range(3):
        s.add(req(f"new{i}", 20))
    step = run_step(s)
    assert step[8:] == [("new0", 20), ("new1", 8)]  # 28 prompt tokens in all
    assert [r.request_id for r in s.waiting] == ["new2"]


def test_prefill_never_starves_however_little_room_steps_leave():
    pace = measured(2.0, 0.0, 0.001)  # no fixed cost: 2 decodes leave room for 2 prompt tokens
    s = decoding_scheduler(pace, 2)
    s.add(req("new", 100))
    assert run_step(s)[2:] == [("new", MIN_PREFILL_TOKENS)]
    assert run_step(s)[2:] == [("new", MIN_PREFILL_TOKENS)]


def test_nothing_decoding_means_the_whole_budget():
    pace = measured(2.0, 0.040, 0.002)
    s = Scheduler(KVCacheManager(num_blocks=512, block_size=4), 64, 512, pace=pace)
    s.add(req("alone", 400))
    assert run_step(s) == [("alone", 400)]


def test_an_offline_batch_prefilling_at_once_keeps_the_full_budget():
    # Every prompt arrives before the first step (LLM.generate): nothing decodes yet, so the
    # first step fills the budget exactly as with the pace off.
    def first_step(pace: DecodePace | None) -> list[tuple[str, int]]:
        s = Scheduler(KVCacheManager(num_blocks=512, block_size=4), 64, 256, pace=pace)
        for i in range(10):
            s.add(req(f"p{i}", 40))
        return run_step(s)

    paced = first_step(measured(2.0, 0.040, 0.002))
    assert paced == first_step(None)
    assert sum(n for _, n in paced) == 256


def test_off_unmeasured_or_without_chunking_the_budget_alone_decides():
    for pace in (measured(0, 0.040, 0.002), DecodePace(2.0), None):
        s = decoding_scheduler(pace, 8, budget=128)
        s.add(req("new", 500))
        assert run_step(s)[8:] == [("new", 120)]
    # Without chunked prefill a prompt goes in whole or not at all: the pace must not hold it out.
    s = Scheduler(KVCacheManager(num_blocks=512, block_size=4), 64, 512, chunked_prefill=False, pace=measured(2.0, 0.040, 0.002))  # fmt: skip
    for i in range(8):
        s.add(req(f"d{i}", 3))
    run_step(s)
    s.add(req("new", 100))
    assert run_step(s)[8:] == [("new", 100)]


def test_a_partly_prefilled_running_prompt_shares_the_cap():
    pace = measured(2.0, 0.040, 0.002)
    s = decoding_scheduler(pace, 8)
    s.add(req("a", 100))
    s.add(req("b", 100))
    assert run_step(s)[8:] == [("a", 28)]
    # a is running and partly prefilled: it takes the step's allowance, b waits its turn.
    assert run_step(s)[8:] == [("a", 28)]
    assert [r.request_id for r in s.waiting] == ["b"]


def test_a_factor_that_cannot_hold_is_refused_with_the_remedy():
    for bad in (1.0, 0.5, -2):
        with pytest.raises(ValueError, match="above 1.*or 0 to turn"):
            DecodePace(bad)


def test_the_engine_measures_its_costs_and_paced_output_equals_unpaced(tiny_models):
    import argparse

    from llmhal import LLM, SamplingParams
    from llmhal.entrypoints.serve import SERVE_DECODE_PACE_FACTOR, apply_serving_defaults

    folder, _ = tiny_models("llama")
    # Two sequences at most: later prompts are admitted while earlier ones decode, under the pace.
    llm = LLM(folder, dtype="float32", max_model_len=128, max_num_seqs=2, enable_prefix_caching=False)  # fmt: skip
    assert llm.engine.pace.factor == 0  # offline: off unless asked
    # Unequal lengths, so a slot frees while the other request still decodes.
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 9, 5, 7, 4, 6)]  # fmt: skip
    prompts = [{"prompt_token_ids": [(7 * i + k) % 50 + 3 for k in range(5 + 9 * i)]} for i in range(6)]  # fmt: skip
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.engine.set_decode_pace(1.5)
    paced = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert paced == plain
    pace = llm.engine.pace
    base, per_token = pace.line()  # type: ignore[misc]
    assert base >= 0 and per_token > 0
    assert pace.prefill_allowance(1) >= MIN_PREFILL_TOKENS
    with pytest.raises(ValueError, match="above 1"):
        llm.engine.set_decode_pace(1.0)
    assert pace.factor == 1.5
    # The server's default, and an explicit 0 kept.
    args = argparse.Namespace(max_num_seqs=8, max_num_batched_tokens=None, decode_pace_factor=None)
    apply_serving_defaults(args)
    assert args.decode_pace_factor == SERVE_DECODE_PACE_FACTOR
    args.decode_pace_factor = 0
    apply_serving_defaults(args)
    assert args.decode_pace_factor == 0


def test_with_graph_chunks_the_cap_is_whole_chunks():
    """The pace's allowance is rounded down to whole graph chunks (at least one), so the second
    prompt's chunk length does not follow the pace."""
    pace = DecodePace(1.5)
    for tokens, ms in ((1, 6.0), (16, 20.0), (64, 66.0)):
        pace.observe(0, tokens, ms / 1e3)
    s = Scheduler(
        KVCacheManager(num_blocks=256, block_size=4), 16, 512, pace=pace, graph_chunk_tokens=8
    )
    allowed = pace.prefill_allowance(4)
    assert allowed is not None and allowed % 8
    assert s._prefill_allowance(4, 512) == max(8, allowed // 8 * 8)
    assert s._prefill_allowance(0, 512) == 512  # nothing decoding: no cap
    # Pieces beside decodes: a whole chunk mid-prompt even where the allowance left is shorter
    # (it is only after a prompt's last piece), never past the step's budget; a last piece in
    # powers of two.
    assert s._chunk_len(4, 30, 512, 4) == 8
    assert s._chunk_len(4, 30, 6, 8) == 4  # a budget below a chunk: a power of two
    assert s._chunk_len(4, 7, 512, 8) == 4
    assert s._chunk_len(4, 7, 512, 2) == 2
    assert s._chunk_len(4, 30, 512, 0) == 0
    assert s._chunk_len(0, 30, 512, 12) == 12  # nothing decoding: the allowance as it is
