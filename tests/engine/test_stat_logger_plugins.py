"""`vllm.stat_logger_plugins`: loaded at engine start, fed after every step, validated."""

from __future__ import annotations

import json

import pytest

from llmhal.testing.distributions import FakeDistribution, build_distributions, run_python

LOGGER = """
import json, os
from llmhal.engine.stat_loggers import StatLoggerBase


class JsonStatLogger(StatLoggerBase):
    def __init__(self, config, engine_index=0):
        self.path = os.environ["STATS_OUT"]
        self.rows = []

    def log_engine_initialized(self):
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": "initialized"}) + "\\n")

    def record(self, scheduler_stats, iteration_stats):
        with open(self.path, "a") as f:
            f.write(json.dumps({"running": scheduler_stats.num_running, "kv": scheduler_stats.kv_cache_usage,
                                "sampled": iteration_stats.num_generation_tokens,
                                "finished": list(iteration_stats.finished_request_ids)}) + "\\n")


class NotALogger:
    pass
"""

RUN = """
import sys
from llmhal import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32")
llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}],
             SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
"""


@pytest.fixture(scope="module")
def plugin_root(tmp_path_factory):
    dist = FakeDistribution(
        "stats-plugin",
        entry_points={
            "vllm.stat_logger_plugins": {
                "json_stats": "stats_plugin:JsonStatLogger",
                "bad_stats": "stats_plugin:NotALogger",
            }
        },  # fmt: skip
        modules={"stats_plugin.py": LOGGER},
    )
    return build_distributions(tmp_path_factory.mktemp("dists"), dist)


def test_engine_feeds_an_allowed_stat_logger_every_step(plugin_root, tiny_models, tmp_path):
    folder, _ = tiny_models("llama")
    out = tmp_path / "stats.jsonl"
    proc = run_python(
        RUN, path=[plugin_root], args=[folder],
        env={"VLLM_PLUGINS": "llmhal_cpu,json_stats", "STATS_OUT": str(out)}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0] == {"event": "initialized"}
    steps = rows[1:]
    assert sum(r["sampled"] for r in steps) >= 6  # 2 requests x 3 tokens (plus the warm-up request)
    assert sorted(r for s in steps for r in s["finished"] if r != "__warmup__") == ["0", "1"]
    assert all(0.0 <= s["kv"] <= 1.0 for s in steps)


def test_a_stat_logger_that_is_not_a_subclass_is_refused_at_engine_start(plugin_root, tiny_models):
    folder, _ = tiny_models("llama")
    proc = run_python(
        RUN,
        path=[plugin_root],
        args=[folder],
        env={"VLLM_PLUGINS": "llmhal_cpu,bad_stats"},
        timeout=300,
    )
    assert proc.returncode != 0
    assert "Stat logger plugin 'bad_stats' must be a subclass of" in proc.stderr
