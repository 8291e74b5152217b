"""Engine configuration records and the "current config" used while a model is built.

Layers read the current config at construction (which attention backend, which quantization,
which dtype), so model classes do not thread it through every constructor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmhal.utils.current import Current

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from llmhal.quantization.base import QuantizationConfig


@dataclass
class ModelConfig:
    """What is being run. ``hf_config`` is the transformers ``PretrainedConfig``."""

    model: str
    hf_config: Any
    dtype: torch.dtype
    architecture: str
    max_model_len: int
    quantization: str | None = None
    gguf_file: str | None = None
    tokenizer: str | None = None
    seed: int = 0
    # Run every step eagerly: no step graphs (see llmhal.engine.decode_graphs).
    enforce_eager: bool = False


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    # Recurrent layers' states (vLLM's names and values, llmhal.attention.state.mamba_state_dtypes):
    # conv and SSM states ("auto": the model's dtype), and the SSM state alone ("auto": as the first).
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    num_blocks: int | None = None  # decided by the engine from the memory budget
    # Reuse the KV of identical leading tokens across requests (vLLM's automatic prefix caching,
    # on by default as in vLLM); a platform may turn it off in check_and_update_config.
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # While requests decode, a step's prompt tokens are limited so it takes at most this many
    # times a decode-only step, by the engine's measured costs (llmhal.engine.step_budget).
    # 0: off, every step may fill its budget (offline batches; ``llmhal serve`` sets 1.5).
    decode_pace_factor: float = 0.0


@dataclass
class ParallelConfig:
    """How the model is split across processes (vLLM's names). ``world_size`` ranks in all: rank
    ``r`` is tensor-parallel rank ``r % tensor_parallel_size`` of pipeline stage
    ``r // tensor_parallel_size``. ``rank`` is this process's own; rank 0 owns the requests."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "uni", "mp", "ray" or "external_launcher" once resolved (llmhal.executor.resolve_backend).
    distributed_executor_backend: str | None = None
    rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: str | None = None
    quant_config: QuantizationConfig | None = None
    device: torch.device | None = None
    # "auto", "xgrammar" or "guidance" (llmhal.structured_output.manager).
    structured_outputs_backend: str = "auto"
    # A reasoning parser's name: structured outputs then start once the reasoning has ended.
    structured_outputs_reasoning_parser: str | None = None
    # A llmhal.spec_decode.config.SpeculativeConfig: speculative decoding with that method.
    speculative_config: Any = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    extra: dict[str, Any] = field(default_factory=dict)


_current: Current[EngineConfig] = Current(
    "No current engine config: build models inside llmhal.config.set_current_config(...) "
    "(the engine does this for you)."
)
# ``with set_current_config(config):`` makes ``config`` current in this thread for the block;
# get_current_config() returns it, and raises RuntimeError (the text above) outside one.
set_current_config = _current.using
get_current_config = _current.get
