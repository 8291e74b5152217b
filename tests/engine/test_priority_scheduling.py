"""``scheduling_policy="priority"`` (vLLM's): lower ``priority`` first, ties by arrival, the lowest
preempted first when the KV cache runs out; fcfs stays the default and refuses a priority; the
server's ``--scheduling-policy priority`` takes the field on completions, chat and responses."""

from __future__ import annotations

import pytest

from llmhal import LLM
from llmhal.engine.sampling_params import SamplingParams
from llmhal.testing.http_client import post_json, running_server

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llms(tiny_models):
    """(fcfs LLM, priority LLM) on the tiny llama, one request running at a time."""
    folder, _ = tiny_models("llama")
    kw = {"dtype": "float32", "max_model_len": 128, "max_num_seqs": 1}
    return LLM(folder, **kw), LLM(folder, scheduling_policy="priority", **kw)


def _admission_order(llm: LLM, priorities: list[int]) -> list[str]:
    """The order requests (queued together, ``a``, ``b``, ... by arrival) are first run in."""
    engine, order = llm.engine, []
    for i, p in enumerate(priorities):
        engine.add_request(f"prompt {i}", GREEDY, request_id="abcdefgh"[i], priority=p)
    while engine.has_unfinished_requests():
        engine.step()
        for req in engine.scheduler.running:
            if req.request_id not in order:
                order.append(req.request_id)
    return order


def test_lower_priority_value_runs_first_ties_by_arrival(llms):
    fcfs, prio = llms
    assert _admission_order(prio, [5, 0, 5, -1, 0]) == ["d", "b", "e", "a", "c"]
    assert _admission_order(fcfs, [0, 0, 0]) == ["a", "b", "c"]
    # The tokens do not depend on the order.
    prompts = ["one two", "three", "four five six"]
    want = [o.outputs[0].token_ids for o in fcfs.generate(prompts, GREEDY, use_tqdm=False)]
    got = prio.generate(prompts, GREEDY, use_tqdm=False, priority=[3, 1, 2])
    assert [o.outputs[0].token_ids for o in got] == want


def test_preemption_takes_the_lowest_priority(tiny_models, llms):
    """Two growing generations in a 4-block cache: one must give way. Under fcfs the later
    arrival does; under priority the one with the higher value, though it came first."""
    folder, _ = tiny_models("llama")
    per_block = llms[0].engine.runner.kv_cache_bytes_per_block()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    # 20 + 30 tokens: 4 blocks each at the end, 8 for the two.
    prompts = [{"prompt_token_ids": list(range(10, 30))}, {"prompt_token_ids": list(range(40, 60))}]
    preempted = {}
    for policy, priority in (("fcfs", None), ("priority", [1, 0])):
        llm = LLM(folder, dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 * per_block,
                  enable_prefix_caching=False, scheduling_policy=policy)  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
        preempted[policy] = [o.metrics.num_preemptions > 0 for o in outs]
        assert [len(o.outputs[0].token_ids) for o in outs] == [30, 30]
    assert preempted == {"fcfs": [False, True], "priority": [True, False]}


def test_refusals_name_the_remedy(llms):
    fcfs, prio = llms
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        fcfs.generate(["x"], GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        prio.generate(["x"], GREEDY, use_tqdm=False, priority=[1, 2])
    with pytest.raises(ValueError, match="must be an integer"):
        prio.generate(["x"], GREEDY, use_tqdm=False, priority=[1.5])
    with pytest.raises(ValueError, match="fcfs, priority"):
        LLM("/nonexistent", scheduling_policy="lifo")
    assert not fcfs.engine.has_unfinished_requests() and not prio.engine.has_unfinished_requests()


def test_the_server_takes_priority_on_every_generating_route(llms):
    _, prio = llms
    with running_server(prio, model_name="tiny") as (base, _):
        for path, body in (
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "priority": -3}),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 7},
            ),  # fmt: skip
            ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "priority": 2}),
        ):
            status, resp = post_json(base + path, body)
            assert status == 200, (path, resp)
            status, resp = post_json(base + path, {**body, "priority": "high"})
            assert status == 400, (path, resp)


def test_serve_has_the_flag():
    import argparse

    from llmhal.entrypoints.engine_args import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args([]).scheduling_policy == "fcfs"
    assert p.parse_args(["--scheduling-policy", "priority"]).scheduling_policy == "priority"
