"""Prometheus metrics for ``llmhal serve``'s ``GET /metrics``: a built-in stat logger.

The names, types and labels are vLLM's (``vllm:`` prefix, ``model_name`` and ``engine`` labels), so
dashboards and alerts written for a vLLM server read an llmhal one unchanged. The text is
Prometheus' exposition format 0.0.4, written here (no client library needed):

* gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
  (a fraction, 0..1, as in vLLM);
* counters ``vllm:prompt_tokens_total`` (a request's whole prompt, once, when its first token
  comes: cached tokens included, recomputation after preemption not, as in vLLM),
  ``vllm:generation_tokens_total``, ``vllm:num_preemptions_total``,
  ``vllm:request_success_total{finished_reason="stop"|"length"|"abort"}``,
  ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total`` (prompt tokens looked
  up in the prefix cache when a request is admitted, and those found); with speculative decoding,
  ``vllm:spec_decode_num_drafts_total``, ``_num_draft_tokens_total``, ``_num_accepted_tokens_total``
  and ``_num_accepted_tokens_per_pos_total{position="0".."k-1"}``;
* histograms ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens``, ``vllm:iteration_tokens_total`` (tokens per engine step).

The engine calls :meth:`PrometheusStatLogger.record` from its loop thread; a scrape reads under a
lock, so it always sees whole steps.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

from llmhal.engine.stat_loggers import IterationStats, SchedulerStats, StatLoggerBase

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket upper bounds. Latencies span a fast step (ms) to a long queue (minutes); token counts are
# powers of 1, 2, 5 up to the context length.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


def token_buckets(max_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_len`` (the last bucket below +Inf covers it)."""
    out: list[float] = []
    scale = 1
    while not out or out[-1] < max_len:
        for m in (1, 2, 5):
            out.append(float(m * scale))
            if out[-1] >= max_len:
                break
        scale *= 10
    return tuple(out)


class Histogram:
    """Counts per bucket (not yet cumulative), the sum and the count of observations."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = 0
        while i < len(self.bounds) and value > self.bounds[i]:
            i += 1
        self.counts[i] += 1
        self.sum += value
        self.count += 1


def _labels(pairs: dict[str, str]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in pairs.items()) + "}"


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


class PrometheusStatLogger(StatLoggerBase):
    """Keeps the engine's metrics and renders them for a scrape (see the module docstring)."""

    def __init__(self, config: Any, engine_index: int = 0, model_name: str | None = None) -> None:
        model = config.model
        self.labels = {"engine": str(engine_index), "model_name": model_name or str(model.model)}
        tokens = token_buckets(max(1, int(model.max_model_len)))
        self._lock = threading.Lock()
        self.gauges = {
            "vllm:num_requests_running": 0.0,
            "vllm:num_requests_waiting": 0.0,
            "vllm:kv_cache_usage_perc": 0.0,
        }
        self.counters = {
            "vllm:prompt_tokens_total": 0.0,
            "vllm:generation_tokens_total": 0.0,
            "vllm:num_preemptions_total": 0.0,
            "vllm:prefix_cache_queries_total": 0.0,
            "vllm:prefix_cache_hits_total": 0.0,
        }
        self.success = dict.fromkeys(FINISH_REASONS, 0.0)
        spec = getattr(config, "speculative_config", None)  # vLLM: only when configured
        if spec is not None:
            for name in _SPEC:
                self.counters[name] = 0.0
        self.per_pos = [0.0] * spec.num_speculative_tokens if spec is not None else None
        self.histograms = {
            "vllm:time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "vllm:inter_token_latency_seconds": Histogram(ITL_BUCKETS),
            "vllm:e2e_request_latency_seconds": Histogram(E2E_BUCKETS),
            "vllm:request_prompt_tokens": Histogram(tokens),
            "vllm:request_generation_tokens": Histogram(tokens),
            "vllm:iteration_tokens_total": Histogram(token_buckets(8192)),
        }

    def log_engine_initialized(self) -> None:
        pass

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        with self._lock:
            if scheduler_stats is not None:
                self.gauges["vllm:num_requests_running"] = scheduler_stats.num_running
                self.gauges["vllm:num_requests_waiting"] = scheduler_stats.num_waiting
                self.gauges["vllm:kv_cache_usage_perc"] = scheduler_stats.kv_cache_usage
                prefix = scheduler_stats.prefix_cache_stats
                if prefix is not None:
                    self.counters["vllm:prefix_cache_queries_total"] += prefix.queries
                    self.counters["vllm:prefix_cache_hits_total"] += prefix.hits
            it = iteration_stats
            if it is None:
                return
            self.counters["vllm:prompt_tokens_total"] += it.num_prompt_tokens
            self.counters["vllm:generation_tokens_total"] += it.num_generation_tokens
            self.counters["vllm:num_preemptions_total"] += it.num_preempted
            spec = it.spec_decoding_stats
            if spec is not None and self.per_pos is not None:
                for name, field in _SPEC.items():
                    self.counters[name] += getattr(spec, field)
                for j, n in enumerate(spec.num_accepted_tokens_per_pos):
                    self.per_pos[j] += n
            h = self.histograms
            tokens = it.num_prompt_tokens + it.num_generation_tokens
            if tokens:  # an abort outside a step is reported as a step that ran nothing
                h["vllm:iteration_tokens_total"].observe(tokens)
            for t in it.time_to_first_tokens:
                h["vllm:time_to_first_token_seconds"].observe(t)
            for t in it.inter_token_latencies:
                h["vllm:inter_token_latency_seconds"].observe(t)
            for f in it.finished_requests:
                self.success[f.finish_reason] = self.success.get(f.finish_reason, 0.0) + 1
                h["vllm:e2e_request_latency_seconds"].observe(f.e2e_latency)
                h["vllm:request_prompt_tokens"].observe(f.num_prompt_tokens)
                h["vllm:request_generation_tokens"].observe(f.num_generation_tokens)

    def render(self) -> str:
        """The exposition text of every metric."""
        lab = self.labels
        lines: list[str] = []

        def head(name: str, kind: str, text: str) -> None:
            lines.append(f"# HELP {name} {text}")
            lines.append(f"# TYPE {name} {kind}")

        with self._lock:
            for name, value in self.gauges.items():
                head(name, "gauge", _HELP[name])
                lines.append(f"{name}{_labels(lab)} {_num(value)}")
            for name, value in self.counters.items():
                head(name, "counter", _HELP[name])
                lines.append(f"{name}{_labels(lab)} {_num(value)}")
            if self.per_pos is not None:
                name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
                head(name, "counter", _HELP[name])
                for j, value in enumerate(self.per_pos):
                    lines.append(f"{name}{_labels({**lab, 'position': str(j)})} {_num(value)}")
            name = "vllm:request_success_total"
            head(name, "counter", _HELP[name])
            for reason, value in self.success.items():
                lines.append(f"{name}{_labels({**lab, 'finished_reason': reason})} {_num(value)}")
            for name, hist in self.histograms.items():
                head(name, "histogram", _HELP[name])
                total = 0
                for bound, n in zip((*hist.bounds, math.inf), hist.counts, strict=True):
                    total += n
                    le = _labels({**lab, "le": _num(bound)})
                    lines.append(f"{name}_bucket{le} {_num(total)}")
                lines.append(f"{name}_count{_labels(lab)} {_num(hist.count)}")
                lines.append(f"{name}_sum{_labels(lab)} {_num(hist.sum)}")
        return "\n".join(lines) + "\n"


_SPEC = {  # counter -> SpecDecodingStats field
    "vllm:spec_decode_num_drafts_total": "num_drafts",
    "vllm:spec_decode_num_draft_tokens_total": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
}
_HELP = {
    "vllm:spec_decode_num_drafts_total": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens_total": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens_total": "Number of accepted tokens.",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": "Accepted tokens per draft position.",
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:prompt_tokens_total": "Number of prefill tokens processed.",
    "vllm:generation_tokens_total": "Number of generation tokens processed.",
    "vllm:num_preemptions_total": "Cumulative number of preemptions from the engine.",
    "vllm:prefix_cache_queries_total": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits_total": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:request_success_total": "Count of finished requests, by finish reason.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:e2e_request_latency_seconds": "Histogram of end-to-end request latency in seconds.",
    "vllm:request_prompt_tokens": "Number of prefill tokens processed, per finished request.",
    "vllm:request_generation_tokens": "Number of generation tokens processed, per finished request.",
    "vllm:iteration_tokens_total": "Histogram of the number of tokens per engine step.",
}
