"""The adaptive switch (llmhal.spec_decode.adaptive) on its own: which windows stop a request, how
long it waits, and how step costs are measured."""

from __future__ import annotations

from llmhal.spec_decode.adaptive import MAX_BACKOFF, PROBE_STEPS, AdaptiveSwitch


def _costs(switch, batch, plain, spec):
    for _ in range(3):
        switch.costs.add(batch, False, plain)
        switch.costs.add(batch, True, spec)


def _wait(switch, rid):
    steps = 0
    while not switch.allows(rid):
        switch.count_down([rid])
        steps += 1
    return steps


def test_drafts_that_do_not_pay_for_the_verification_stop_the_request():
    switch = AdaptiveSwitch(0.0, True, window=4, retry_after_steps=0)
    _costs(switch, 1, plain=0.010, spec=0.015)  # a verification step costs 1.5 decode steps
    for _ in range(4):  # 1 + 0.75 tokens a step: more than 1.5, it pays
        switch.record("a", 3, 1 if _ else 0, 1)
    assert switch.allows("a")
    for accepted in (0, 1, 0, 0):  # 1.25 tokens a step: less than 1.5
        switch.record("a", 3, accepted, 1)
    assert not switch.allows("a")
    for _ in range(100):  # retry_after_steps=0: stopped for good
        switch.count_down(["a"])
    assert switch.stopped("a")


def test_without_plain_steps_at_the_batch_size_the_request_pauses_to_time_them():
    switch = AdaptiveSwitch(0.0, True, window=2, retry_after_steps=8)
    _costs(switch, 8, plain=0.010, spec=0.100)  # measured at batch 8 only
    switch.record("a", 3, 0, 1)
    switch.record("a", 3, 0, 1)
    assert _wait(switch, "a") == PROBE_STEPS
    for _ in range(3):
        switch.costs.add(1, False, 0.010)
        switch.costs.add(1, True, 0.012)
    switch.record("a", 3, 0, 1)
    switch.record("a", 3, 1, 1)  # 1.5 tokens a step against a cost of 1.2: pays
    assert switch.allows("a")
    switch.record("a", 3, 0, 1)
    switch.record("a", 3, 0, 1)  # 1 token a step: stopped for retry_after_steps
    assert _wait(switch, "a") == 8


def test_the_wait_doubles_while_windows_fail_and_resets_when_one_pays():
    switch = AdaptiveSwitch(0.5, False, window=2, retry_after_steps=3)
    waits = []
    for _ in range(MAX_BACKOFF.bit_length() + 1):
        switch.record("a", 2, 0, 1)
        switch.record("a", 2, 0, 1)
        waits.append(_wait(switch, "a"))
    assert waits == [3 * 2**i for i in range(len(waits) - 1)] + [3 * MAX_BACKOFF]
    switch.record("a", 2, 2, 1)
    switch.record("a", 2, 1, 1)  # 3 of 4 accepted: pays, the wait starts over
    switch.record("a", 2, 0, 1)
    switch.record("a", 2, 0, 1)
    assert _wait(switch, "a") == 3


def test_steps_are_timed_per_batch_size_and_kind_leaving_out_joins_and_first_shapes():
    switch = AdaptiveSwitch(0.0, True, window=4, retry_after_steps=8)
    switch.step_done(["a"])  # the first step has no start
    for verified in (False, True) * 4:
        if verified:
            switch.record("a", 2, 1, 1)
        switch.step_done(["a"])
    switch.record("a", 3, 1, 1)  # a new shape (3 drafts): may have recorded a graph
    switch.step_done(["a"])
    switch.step_done(["a", "b"])  # b joined: its prefill ran in this step
    # Of 4 steps of each kind the first of each shape is left out.
    assert {key: len(v) for key, v in switch.costs.samples.items()} == {(1, False): 3, (1, True): 3}
    assert switch.costs.ratio(1) is not None and switch.costs.ratio(2) is None
    switch.finish("a")
    assert switch.allows("a")


def test_a_new_request_starts_stopped_while_stops_repeat_across_requests():
    switch = AdaptiveSwitch(0.5, False, window=2, retry_after_steps=3)
    for _ in range(2):  # a stopped twice: only a waits (its text may be hard to draft)
        switch.record("a", 2, 0, 1)
        switch.record("a", 2, 0, 1)
        _wait(switch, "a")
    assert switch.allows("b")
    switch.record("b", 2, 0, 1)
    switch.record("b", 2, 0, 1)  # b stopped too: waits 3, its next wait would be 6
    assert _wait(switch, "c") == 6
    switch.record("b", 2, 2, 1)
    switch.record("b", 2, 2, 1)  # pays: the next request drafts at once
    assert switch.allows("c")


def test_each_verification_is_weighed_at_its_own_draft_length():
    switch = AdaptiveSwitch(0.0, True, window=4, retry_after_steps=8)
    for _ in range(3):
        switch.costs.add(1, False, 0.010)
        switch.costs.add(1, True, 0.012, drafts=2)  # 1.2 decode steps
    for _ in range(6):
        switch.costs.add(1, True, 0.020, drafts=6)  # 2.0: the pooled median too
    assert switch.costs.ratio(1) == 2.0 and switch.costs.ratio(1, 2) == 1.2
    assert switch.costs.ratio(1, 4) == 2.0  # not timed at 4 drafts: the pooled figure
    for accepted in (1, 0, 1, 0):  # 1.5 tokens a step for 1.2: short drafts pay
        switch.record("a", 2, accepted, 1)
    assert switch.allows("a")
    for accepted in (1, 0, 1, 0):  # the same from 6-token drafts, costing 2.0: stopped
        switch.record("b", 6, accepted, 1)
    assert not switch.allows("b")


def test_drafts_that_cannot_pay_even_when_all_accepted_stop_every_request_at_once():
    switch = AdaptiveSwitch(0.0, True, window=4, retry_after_steps=16)
    for _ in range(3):
        switch.costs.add(1, False, 0.010)
        switch.costs.add(1, True, 0.030, drafts=2)  # 3.0 decode steps for at most 3 tokens
        switch.costs.add(1, True, 0.025, drafts=4)  # 2.5 for at most 5: may pay
    switch.record("a", 4, 4, 1)
    assert switch.allows("a")  # a window decides
    switch.record("a", 2, 2, 1)  # all accepted, and still no gain: stopped at once
    assert _wait(switch, "a") == 16 * MAX_BACKOFF
    assert _wait(switch, "b") == 16 * MAX_BACKOFF  # new requests too
    for _ in range(4):
        switch.record("b", 4, 4, 1)  # a window that pays clears it
    assert switch.allows("c")
    # Untimed lengths, or the pooled figure alone, never decide it.
    fresh = AdaptiveSwitch(0.0, True, window=4, retry_after_steps=16)
    _costs(fresh, 1, plain=0.010, spec=0.050)
    fresh.record("a", 2, 0, 1)
    assert fresh.allows("a")
