"""`llmhal serve`'s GET /metrics (read with prometheus_client's own parser), GET /version, and
POST /tokenize and /detokenize, on a tiny model."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import llmhal
from llmhal import LLM, SamplingParams
from llmhal.engine.stat_loggers import FinishedRequestStats, IterationStats, SchedulerStats
from llmhal.entrypoints.metrics import PrometheusStatLogger, token_buckets


def post(url: str, body: dict):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    """(sample name, labels other than model_name and engine) -> value."""
    with urllib.request.urlopen(base + "/metrics") as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels["model_name"] == "tiny" and s.labels["engine"] == "0"
            rest = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))  # fmt: skip
            out[(s.name, rest)] = s.value
    return out


def delta(after: dict, before: dict, name: str, labels: tuple = ()) -> float:
    return after[(name, labels)] - before.get((name, labels), 0.0)


def test_metrics_count_a_completions_tokens_and_latencies(server):
    base, _ = server
    before = scrape(base)
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    status, resp = post(base + "/v1/completions", body)
    elapsed = time.monotonic() - t0
    assert status == 200, resp
    after = scrape(base)
    # Latencies are real: first token <= end to end <= what the client waited.
    ttft = delta(after, before, "vllm:time_to_first_token_seconds_sum")
    e2e = delta(after, before, "vllm:e2e_request_latency_seconds_sum")
    assert 0 < ttft <= e2e <= elapsed
    assert delta(after, before, "vllm:prompt_tokens_total") == 4
    assert delta(after, before, "vllm:generation_tokens_total") == 5
    assert delta(after, before, "vllm:request_success_total", (("finished_reason", "length"),)) == 1
    assert delta(after, before, "vllm:request_success_total", (("finished_reason", "stop"),)) == 0
    assert delta(after, before, "vllm:time_to_first_token_seconds_count") == 1
    assert delta(after, before, "vllm:inter_token_latency_seconds_count") == 4
    assert delta(after, before, "vllm:e2e_request_latency_seconds_count") == 1
    assert delta(after, before, "vllm:request_generation_tokens_sum") == 5
    assert delta(after, before, "vllm:request_prompt_tokens_sum") == 4
    # Idle again: nothing running or waiting.
    assert after[("vllm:num_requests_running", ())] == 0
    assert after[("vllm:num_requests_waiting", ())] == 0
    # Buckets are cumulative and end in +Inf == count.
    name = "vllm:request_generation_tokens_bucket"
    assert after[(name, (("le", "+Inf"),))] == after[("vllm:request_generation_tokens_count", ())]
    assert delta(after, before, name, (("le", "2.0"),)) == 0
    assert delta(after, before, name, (("le", "5.0"),)) == 1  # le is inclusive


def test_version_and_unknown_routes(server):
    base, _ = server
    with urllib.request.urlopen(base + "/version") as r:
        assert json.load(r) == {"version": llmhal.__version__}
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(base + "/nope")
    assert e.value.code == 404


def test_tokenize_gives_the_ids_the_completion_endpoints_use(server):
    base, llm = server
    tok = llm.get_tokenizer()
    status, resp = post(base + "/tokenize", {"prompt": "hello world", "return_token_strs": True})
    assert status == 200, resp
    ids = tok.encode("hello world", add_special_tokens=True)
    assert resp == {"count": len(ids), "max_model_len": 128, "tokens": ids,
                    "token_strs": tok.convert_ids_to_tokens(ids)}  # fmt: skip
    messages = [{"role": "user", "content": "hi"}]
    status, resp = post(base + "/tokenize", {"model": "tiny", "messages": messages})
    assert status == 200, resp
    assert resp["tokens"] == llm.chat_prompt(messages)["prompt_token_ids"]
    assert resp["token_strs"] is None
    status, resp = post(base + "/detokenize", {"tokens": ids})
    assert status == 200 and resp == {"prompt": tok.decode(ids)}


@pytest.mark.parametrize(
    "route, body, words",
    [
        ("/tokenize", {"prompt": "a", "messages": []}, "either"),
        ("/tokenize", {}, "either"),
        ("/tokenize", {"prompt": [1, 2]}, "must be a string"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "true or false"),
        ("/detokenize", {"tokens": [1, 10**9]}, "outside the vocabulary"),
        ("/detokenize", {"tokens": "1 2"}, "list of token ids"),
        ("/detokenize", {"tokens": [1, True]}, "list of token ids"),
        ("/detokenize", {"tokens": [1], "model": "other"}, "does not exist"),
    ],
)
def test_tokenize_errors_name_the_problem(server, route, body, words):
    base, _ = server
    status, resp = post(base + route, body)
    assert status in (400, 404)
    assert words in resp["error"]["message"]


class _Config:
    class model:  # the attribute path the logger reads (config.model.*)
        model = "/models/m.gguf"
        max_model_len = 300


def test_the_logger_keeps_vllms_bucket_rule_and_counts_aborts():
    log = PrometheusStatLogger(_Config(), model_name='a "quoted"\nname')
    aborted = FinishedRequestStats("r", "abort", 7, 0, 2.5, None)
    log.record(SchedulerStats(1, 2, 0.25, 0), IterationStats(0.0, 0, 0, ("r",), 0, finished_requests=(aborted,)))  # fmt: skip
    log.record(None, IterationStats(0.1, 3, 2, (), 1, time_to_first_tokens=(0.01,), inter_token_latencies=(0.01, 0.3)))  # fmt: skip
    samples = {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "engine"))): s.value
        for f in text_string_to_metric_families(log.render())
        for s in f.samples
    }
    lab = (("model_name", 'a "quoted"\nname'),)  # escaped and read back intact
    assert samples[("vllm:request_success_total", (("finished_reason", "abort"), *lab))] == 1
    assert samples[("vllm:num_requests_waiting", lab)] == 2
    assert samples[("vllm:kv_cache_usage_perc", lab)] == 0.25
    assert samples[("vllm:num_preemptions_total", lab)] == 1
    # The abort ran nothing: one step observed in the iteration histogram, of 5 tokens.
    assert samples[("vllm:iteration_tokens_total_count", lab)] == 1
    assert samples[("vllm:iteration_tokens_total_sum", lab)] == 5
    itl = "vllm:inter_token_latency_seconds_bucket"
    assert samples[(itl, (("le", "0.01"), *lab))] == 1  # a value on a bound counts in it
    assert samples[(itl, (("le", "0.2"), *lab))] == 1
    assert samples[(itl, (("le", "0.3"), *lab))] == 2
    assert token_buckets(300) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    assert token_buckets(1) == (1,)


def test_the_engine_reports_aborts_and_skips_its_warmup(tiny_models):
    folder, _ = tiny_models("llama")
    llm = LLM(folder, dtype="float32", max_model_len=64)
    engine = llm.engine
    seen: list[IterationStats] = []

    class Recorder(PrometheusStatLogger):
        def record(self, sched, it):
            seen.append(it)
            super().record(sched, it)

    engine.stat_loggers.append(Recorder(engine.config))
    engine.warmup()  # a warm-up is nobody's request
    assert seen == []
    rid = engine.add_request({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=8, ignore_eos=True))  # fmt: skip
    engine.step()  # prefill and first token
    engine.step()
    engine.abort_request(rid)
    assert [len(it.time_to_first_tokens) for it in seen] == [1, 0, 0]
    assert [len(it.inter_token_latencies) for it in seen] == [0, 1, 0]
    (done,) = seen[-1].finished_requests
    assert (done.request_id, done.finish_reason) == (rid, "abort")
    assert (done.num_prompt_tokens, done.num_generation_tokens) == (3, 2)
    assert done.time_to_first_token is not None and done.e2e_latency >= done.time_to_first_token
    assert seen[-1].step_seconds == 0 and seen[-1].num_generation_tokens == 0


def test_response_ids_have_openais_shape_and_are_unique(server):
    base, _ = server
    body = {"prompt": [5, 6], "max_tokens": 1}
    ids = {post(base + "/v1/completions", body)[1]["id"] for _ in range(2)}
    assert len(ids) == 2 and all(i.startswith("cmpl-") for i in ids)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert post(base + "/v1/chat/completions", chat)[1]["id"].startswith("chatcmpl-")


def test_prefix_cache_counters_and_cache_salt(server):
    base, _ = server
    prompt = [(7 * i + 3) % 200 + 10 for i in range(40)]  # 2 full blocks of 16 can be reused
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    assert post(base + "/v1/completions", {**body, "cache_salt": "first"})[0] == 200
    before = scrape(base)
    for salt in ("first", "second"):
        status, resp = post(base + "/v1/completions", {**body, "cache_salt": salt})
        assert status == 200, resp
    after = scrape(base)
    # Same salt: 32 of 40 tokens found; another salt: nothing.
    assert delta(after, before, "vllm:prefix_cache_queries_total") == 80
    assert delta(after, before, "vllm:prefix_cache_hits_total") == 32
    assert delta(after, before, "vllm:prompt_tokens_total") == 80  # whole prompts, as in vLLM
    status, resp = post(base + "/v1/completions", {**body, "cache_salt": ""})
    assert status == 400 and "cache_salt" in resp["error"]["message"]
