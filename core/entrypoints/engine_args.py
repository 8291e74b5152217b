"""Engine options shared by the CLI commands that start an engine (``generate``, ``serve``)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.engine.llm import LLM


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model and how the engine runs it: the options every engine-starting command takes."""
    from llmhal.attention.state import MAMBA_CACHE_DTYPES

    p.add_argument(
        "--model",
        help="model folder (config.json + safetensors) or .gguf file; default: SmolLM2-135M-Instruct",
    )
    p.add_argument(
        "--tokenizer", help="folder with the tokenizer's files (default: the model's own)"
    )
    p.add_argument("--attention-backend", help="attention backend (default: the platform's choice)")
    p.add_argument("--quantization", help="quantization method (default: from the checkpoint)")
    p.add_argument(
        "--dtype",
        default="auto",
        help="float32, bfloat16 or float16 (default auto: the checkpoint's where the platform runs "
        "it well)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (the model dtype, default), fp8_e4m3 (alias fp8), fp8_e5m2, int8 or nvfp4 where "
        "the backend supports it (docs/quantization.md, KV cache formats)",
    )
    p.add_argument(
        "--mamba-cache-dtype",
        default="auto",
        choices=MAMBA_CACHE_DTYPES,
        help="recurrent layers' conv and SSM states (and linear attention's): auto (the model "
        "dtype, default), float32, bfloat16 or float16 where the platform's kernels serve it",
    )
    p.add_argument(
        "--mamba-ssm-cache-dtype",
        default="auto",
        choices=MAMBA_CACHE_DTYPES,
        help="the SSM state alone: auto (as --mamba-cache-dtype, default) or a dtype; float32 "
        "keeps it at full precision in a half-precision model (docs/state-space-models.md)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="context length in tokens (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--structured-outputs-backend",
        "--structured-outputs-config.backend",  # vLLM's spelling
        dest="structured_outputs_backend",
        default="auto",
        choices=("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"),
        help="what compiles requests' structured outputs (default auto: xgrammar, else guidance; "
        "outlines and lm-format-enforcer only when named)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="tokens one engine step computes at most; longer prompts are prefilled in chunks "
        "(default: max(2048, min(max-model-len, 8192))). Smaller keeps running streams "
        "moving while a long prompt is prefilled, at some prefill speed",
    )
    p.add_argument(
        "--decode-pace-factor",
        type=float,
        metavar="F",
        help="while requests decode, limit the prompt tokens a step adds so it takes at most F "
        "times a decode-only step, by the engine's measured costs (at least 16 tokens a step; "
        "0: off, every step fills its budget). Default: 1.5 for llmhal serve, off otherwise",
    )
    p.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV-cache block (default 16)"
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        help="size the KV cache explicitly (default: the platform's memory budget)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of leading tokens shared with earlier requests (default: on)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly (no recorded decode-step graphs)",
    )
    p.add_argument(
        "--speculative-config",
        metavar="JSON|@FILE",
        help="speculative decoding, vLLM's dict as JSON (or @file holding it), e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\'; methods: ngram, suffix, '
        "draft_model, and any a plugin registers",
    )
    p.add_argument(
        "--pooler-config",
        metavar="JSON",
        help="how embeddings and /pooling pool (vLLM's PoolerConfig as JSON), e.g. "
        '\'{"pooling_type": "MEAN", "normalize": true}\'; pooling_type LAST (default), MEAN, '
        "CLS or ALL",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split each layer over this many ranks (processes; default 1)",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="split the layers into this many stages, one rank group each (default 1)",
    )
    p.add_argument(
        "--distributed-executor-backend",
        choices=("mp", "ray", "external_launcher", "uni"),
        help="what runs the ranks: mp (local processes; the default for more than one rank), "
        "ray (a Ray cluster), external_launcher (one process per rank started by torchrun)",
    )
    p.add_argument(
        "--io-processor-plugin",
        metavar="NAME",
        help="the IO processor /pooling requests with 'data' go through: a "
        "vllm.io_processor_plugins entry point or the built-in similarity_ranking",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="fcfs (default): requests run by arrival; priority: by each request's 'priority' "
        "(lower first, ties by arrival; the lowest is preempted first when the KV cache is full)",
    )


def _structured_outputs_config(args: argparse.Namespace) -> dict[str, Any]:
    """The backend, and ``serve``'s ``--reasoning-parser`` (vLLM's rule: it also makes
    constrained requests wait for the reasoning to end)."""
    config: dict[str, Any] = {"backend": getattr(args, "structured_outputs_backend", "auto")}
    if getattr(args, "reasoning_parser", None):
        config["reasoning_parser"] = args.reasoning_parser
    return config


def build_llm(prog: str, args: argparse.Namespace, **extra: Any) -> LLM | None:
    """The engine for ``args`` (plus ``extra`` LLM arguments), or None after printing why not.

    A bad model path, an unknown backend or method, a missing optional library: the message is the
    engine's own, which names the remedy; the caller exits with status 2.
    """
    from llmhal.engine.llm import LLM
    from llmhal.spec_decode.config import parse_cli_value

    try:
        spec = getattr(args, "speculative_config", None)
        pace = getattr(args, "decode_pace_factor", None)
        if pace:
            from llmhal.engine.step_budget import DecodePace

            DecodePace(pace)  # a bad factor is refused before the model loads
        llm = LLM(
            args.model, dtype=args.dtype, attention_backend=args.attention_backend,
            quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
            mamba_cache_dtype=getattr(args, "mamba_cache_dtype", "auto"),
            mamba_ssm_cache_dtype=getattr(args, "mamba_ssm_cache_dtype", "auto"),
            max_model_len=args.max_model_len, enforce_eager=getattr(args, "enforce_eager", False),
            tokenizer=args.tokenizer, enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
            max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
            block_size=getattr(args, "block_size", 16),
            kv_cache_memory_bytes=getattr(args, "kv_cache_memory_bytes", None),
            structured_outputs_config=_structured_outputs_config(args),
            speculative_config=None if spec is None else parse_cli_value(spec),
            pooler_config=getattr(args, "pooler_config", None),
            io_processor_plugin=getattr(args, "io_processor_plugin", None),
            scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
            tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
            pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
            distributed_executor_backend=getattr(args, "distributed_executor_backend", None),
            **extra,
        )  # fmt: skip
        if pace:
            llm.engine.set_decode_pace(pace)
        return llm
    except (
        ValueError,
        OSError,
        ImportError,
        RuntimeError,
        KeyError,
    ) as e:  # OSError: unreadable files
        print(f"{prog}: {e}", file=sys.stderr)
        return None
