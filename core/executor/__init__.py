"""Executors: what runs a model's ranks (vLLM's ``distributed_executor_backend``).

``uni`` runs the one rank in the engine's process; ``mp`` spawns ranks 1..N-1 as local processes
(rank 0 is the engine's own); ``ray`` places them as Ray actors; ``external_launcher`` expects one
process per rank started by ``torchrun``, each running the whole engine. The contract is
:class:`llmhal.executor.base.Executor`. Importing this package is cheap; a backend's module (and
Ray) is imported only when that backend is chosen.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.config import EngineConfig, ParallelConfig
    from llmhal.executor.base import Executor

# name -> "module:Class", imported on first use (ray's module imports Ray).
EXECUTOR_BACKENDS: dict[str, str] = {
    "uni": "llmhal.executor.uni:UniProcExecutor",
    "mp": "llmhal.executor.mp:MultiprocExecutor",
    "ray": "llmhal.executor.ray:RayExecutor",
    "external_launcher": "llmhal.executor.external_launcher:ExternalLauncherExecutor",
}


def resolve_parallel(
    tensor_parallel_size: int, pipeline_parallel_size: int, backend: str | None
) -> ParallelConfig:
    """Check the sizes and pick the backend (vLLM's default: ``uni`` for one rank, else ``mp``)."""
    from llmhal.config import ParallelConfig

    for name, value in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("pipeline_parallel_size", pipeline_parallel_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    world = tensor_parallel_size * pipeline_parallel_size
    if backend is None:
        backend = "uni" if world == 1 else "mp"
    if backend not in EXECUTOR_BACKENDS:
        raise ValueError(
            f"Unknown distributed executor backend: {backend!r}; use one of "
            f"{', '.join(EXECUTOR_BACKENDS)}"
        )
    if backend == "uni" and world > 1:
        raise ValueError(
            f"distributed_executor_backend='uni' runs one process, but tensor_parallel_size x "
            f"pipeline_parallel_size = {world}; use 'mp', 'ray' or 'external_launcher'"
        )
    return ParallelConfig(tensor_parallel_size, pipeline_parallel_size, backend)


def executor_class(backend: str) -> type[Executor]:
    module, _, cls = EXECUTOR_BACKENDS[backend].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_executor(config: EngineConfig, args: Any) -> Executor:
    """The executor ``config.parallel`` names, for an engine built from ``args`` (the
    :class:`~llmhal.engine.builder.EngineArgs`, which other ranks rebuild their config from)."""
    backend = config.parallel.distributed_executor_backend or "uni"
    return executor_class(backend)(config, args)
