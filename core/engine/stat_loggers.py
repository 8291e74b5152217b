"""Engine statistics and the ``vllm.stat_logger_plugins`` group.

A stat-logger plugin's entry point names a :class:`StatLoggerBase` subclass (a class, not a factory,
as in vLLM). At engine start llmhal imports the allowed ones, rejects anything that is not such a
subclass with a :class:`TypeError` naming the plugin, instantiates each with ``(config, engine_index)``
and calls :meth:`StatLoggerBase.log_engine_initialized`. After every step it calls
:meth:`StatLoggerBase.record` with a :class:`SchedulerStats` and an :class:`IterationStats`. A logger
that raises is logged once and dropped, so metrics never take serving down.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from llmhal.logger import init_logger

logger = init_logger(__name__)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last report (vLLM's): admitted requests, their tokens
    looked up (queries) and the tokens found cached (hits)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's state after a step."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV-cache blocks in use, 0..1
    num_preemptions_total: int
    # Lookups since the previous report; None when prefix caching is off.
    prefix_cache_stats: PrefixCacheStats | None = None


@dataclass(frozen=True)
class FinishedRequestStats:
    """One request that ended: how (``"stop"``, ``"length"`` or ``"abort"``), its token counts, and
    its latencies in seconds from arrival (``time_to_first_token`` None: it produced none)."""

    request_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    time_to_first_token: float | None


@dataclass(frozen=True)
class IterationStats:
    """What one step did. The per-request fields are filled only when stat loggers are loaded;
    ``finished_requests`` also holds requests aborted since the previous step."""

    step_seconds: float
    # The whole prompts (cached tokens included) of the requests whose first token came this
    # step (vLLM's count: chunks before it and recomputation after preemption add nothing).
    num_prompt_tokens: int
    num_generation_tokens: int  # tokens generated this step (several a request when speculating)
    finished_request_ids: tuple[str, ...] = field(default_factory=tuple)
    num_preempted: int = 0
    # Seconds from arrival, for each request whose first token came this step.
    time_to_first_tokens: tuple[float, ...] = ()
    # Seconds since the previous token, for each request that got a later token this step.
    inter_token_latencies: tuple[float, ...] = ()
    finished_requests: tuple[FinishedRequestStats, ...] = ()
    # Speculative decoding this step (a llmhal.spec_decode.speculator.SpecDecodingStats: drafts
    # verified, their tokens, those accepted, accepted per position); None when none was verified.
    spec_decoding_stats: Any = None


class StatLoggerBase(ABC):
    """Base class of engine stat loggers (built-in or from ``vllm.stat_logger_plugins``)."""

    @abstractmethod
    def __init__(self, config: Any, engine_index: int = 0) -> None: ...

    @abstractmethod
    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        """Called after every engine step."""

    @abstractmethod
    def log_engine_initialized(self) -> None:
        """Called once, when the engine is ready."""

    def log(self) -> None:
        """Called periodically by long-running front ends to emit a summary (optional)."""


def load_stat_loggers(config: Any, engine_index: int = 0) -> list[StatLoggerBase]:
    """Instantiate the allowed stat-logger plugins (in discovery order)."""
    from llmhal.plugins import STAT_LOGGER_PLUGINS_GROUP, load_plugins_by_group

    out = []
    for name, cls in load_plugins_by_group(STAT_LOGGER_PLUGINS_GROUP).items():
        if not (isinstance(cls, type) and issubclass(cls, StatLoggerBase)):
            raise TypeError(
                f"Stat logger plugin {name!r} must be a subclass of llmhal.engine.stat_loggers."
                f"StatLoggerBase, got {cls!r}; fix the plugin or exclude it with VLLM_PLUGINS."
            )
        out.append(cls(config, engine_index))
    for stat_logger in out:
        stat_logger.log_engine_initialized()
    return out


def record_all(loggers: list[StatLoggerBase], sched: SchedulerStats, it: IterationStats) -> None:
    """Feed every logger; drop (after logging once) any that raises."""
    for stat_logger in list(loggers):
        try:
            stat_logger.record(sched, it)
        except Exception:
            logger.exception("Stat logger %s raised and is disabled", type(stat_logger).__name__)
            loggers.remove(stat_logger)
