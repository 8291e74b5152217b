"""IO processors (vLLM's ``IOProcessor`` contract): turn a request's ``data`` into prompts, and the
pooled outputs into the answer.

A processor is chosen by name, ``LLM(io_processor_plugin=NAME)`` / ``--io-processor-plugin NAME``,
or else the model config's ``io_processor_plugin`` key (the argument wins, as in vLLM). The name is
looked up among the ``vllm.io_processor_plugins`` entry points (each a zero-argument callable
returning the processor's class path, or None), then among llmhal's built-ins
(:data:`BUILTIN_IO_PROCESSORS`). Only the requested entry point is imported (``VLLM_PLUGINS``
applies), in the process that owns the LLM: process 0, the only one that sees requests.

When each member is called, for one ``/pooling`` request with a ``data`` field (or ``LLM.encode``
given ``{"data": ...}``): :meth:`IOProcessor.parse_request` (the request body, or the offline dict)
-> :meth:`~IOProcessor.pre_process_async` (prompts) -> :meth:`~IOProcessor.validate_or_generate_params`
-> the prompts are pooled -> :meth:`~IOProcessor.post_process_async` -> :meth:`~IOProcessor.output_to_response`
(the server's answer; offline callers get post_process's value). llmhal also passes the parsed
input to post_process as the keyword ``request`` (vLLM's signature takes ``**kwargs``). An exception
from any member is the request's error (a 400 for ValueError/TypeError on the server).
"""

from __future__ import annotations

import abc
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from llmhal.logger import init_logger
from llmhal.pooling.params import PoolingParams

logger = init_logger(__name__)

IOProcessorInput = TypeVar("IOProcessorInput")
IOProcessorOutput = TypeVar("IOProcessorOutput")

# name -> class path of the processors llmhal ships (an entry point of the same name wins).
BUILTIN_IO_PROCESSORS = {"similarity_ranking": "llmhal.pooling.similarity:SimilarityRanking"}


@dataclass
class IOProcessorResponse:
    """What ``/pooling`` answers for a processor's request: ``{request_id, created_at, data}``."""

    data: Any
    request_id: str | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))


class IOProcessor(abc.ABC, Generic[IOProcessorInput, IOProcessorOutput]):
    """Base class of IO processors; ``config`` is the engine's :class:`llmhal.config.EngineConfig`."""

    def __init__(self, config: Any) -> None:
        self.config = config

    @abc.abstractmethod
    def parse_request(self, request: Any) -> IOProcessorInput:
        """The processor's input from a request (a JSON body's dict, or an offline prompt dict
        with ``data``); raise ValueError for one it cannot take."""

    @abc.abstractmethod
    def pre_process(self, prompt: IOProcessorInput, request_id: str | None = None, **kwargs: Any) -> Any:  # fmt: skip
        """The engine prompts (a prompt or a sequence of them: text or ``{"prompt_token_ids"}``)."""

    async def pre_process_async(self, prompt: IOProcessorInput, request_id: str | None = None, **kwargs: Any) -> Any:  # fmt: skip
        return self.pre_process(prompt, request_id, **kwargs)

    @abc.abstractmethod
    def post_process(self, model_output: Sequence[Any], request_id: str | None = None, **kwargs: Any) -> IOProcessorOutput:  # fmt: skip
        """The answer from the prompts' PoolingRequestOutputs, in prompt order."""

    async def post_process_async(self, model_output: AsyncIterator[tuple[int, Any]], request_id: str | None = None, **kwargs: Any) -> IOProcessorOutput:  # fmt: skip
        """Collects ``(index, output)`` pairs, puts them in index order, calls post_process."""
        pairs = [item async for item in model_output]
        return self.post_process([out for _, out in sorted(pairs, key=lambda p: p[0])], request_id, **kwargs)  # fmt: skip

    def validate_or_generate_params(self, params: PoolingParams | None = None) -> PoolingParams:
        return params if params is not None else PoolingParams()

    @abc.abstractmethod
    def output_to_response(self, plugin_output: IOProcessorOutput) -> IOProcessorResponse:
        """The server's answer."""


def io_processor_name(config: Any, requested: str | None) -> str | None:
    """The argument, else the model config's ``io_processor_plugin``, else None."""
    return requested or getattr(config.model.hf_config, "io_processor_plugin", None)


def load_io_processor(config: Any, requested: str | None) -> IOProcessor | None:
    """The processor the engine is asked to use, instantiated with ``config``; None when none is
    asked for; ValueError naming the available ones when the name matches none."""
    name = io_processor_name(config, requested)
    if name is None:
        return None
    processor = find_io_processor(name)(config)
    logger.info("IO processor %r: %s", name, type(processor).__qualname__)
    return processor


def find_io_processor(name: str) -> type[IOProcessor]:
    """The class of the processor called ``name``: its entry point's (only that one is imported;
    ``VLLM_PLUGINS`` applies), else a built-in's; ValueError naming the available ones."""
    from llmhal.plugins import IO_PROCESSOR_PLUGINS_GROUP, discover, load_plugins_by_group
    from llmhal.utils.imports import resolve_obj_by_qualname

    loaded = load_plugins_by_group(IO_PROCESSOR_PLUGINS_GROUP, only=frozenset({name}))
    if name in loaded:
        try:
            path = loaded[name]()
        except Exception as e:
            raise ValueError(f"IO processor plugin {name!r} failed when called: {type(e).__name__}: {e}") from e  # fmt: skip
        if path is None:
            raise ValueError(f"IO processor plugin {name!r} returned None: it is not available here")  # fmt: skip
    elif name in BUILTIN_IO_PROCESSORS:
        path = BUILTIN_IO_PROCESSORS[name]
    else:
        names = sorted({ep.name for ep in discover(IO_PROCESSOR_PLUGINS_GROUP)} | set(BUILTIN_IO_PROCESSORS))  # fmt: skip
        raise ValueError(
            f"IO processor plugin {name!r} is not installed (or not allowed by VLLM_PLUGINS); "
            f"available: {', '.join(names)}. Install the package that provides it, or pick one "
            "of these with --io-processor-plugin / LLM(io_processor_plugin=...)"
        )
    cls = resolve_obj_by_qualname(path)
    if not (isinstance(cls, type) and issubclass(cls, IOProcessor)):
        raise ValueError(
            f"IO processor plugin {name!r} gave {path!r}, which is not a subclass of "
            "llmhal.pooling.io_processor.IOProcessor"
        )
    return cls


async def run_io_processor(processor: IOProcessor, request: Any, pool: Any, request_id: str | None = None) -> tuple[Any, Any]:  # fmt: skip
    """One request through ``processor``: (post_process's value, the parsed input). ``pool`` is an
    async callable (prompts, PoolingParams) -> PoolingRequestOutputs in prompt order."""
    parsed = processor.parse_request(request)
    prompts = await processor.pre_process_async(parsed, request_id)
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    params = processor.validate_or_generate_params()
    outs = await pool(list(prompts), params)

    async def pairs() -> AsyncIterator[tuple[int, Any]]:
        for item in enumerate(outs):
            yield item

    return await processor.post_process_async(pairs(), request_id, request=parsed), parsed
