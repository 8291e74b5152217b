"""From user arguments to a running engine: checkpoint, dtype, quantization, model, KV cache.

Every check that can fail (platform, dtype, quantization, context length) runs before any weight
loads, so a bad request costs nothing and says what to do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from llmhal.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    set_current_config,
)
from llmhal.logger import init_logger
from llmhal.model_loader.progress import LoadProgress

logger = init_logger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}  # fmt: skip


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    attention_backend: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    enforce_eager: bool = False
    load_progress: bool | None = None  # None: only when stderr is a terminal
    structured_outputs_backend: str = "auto"
    structured_outputs_reasoning_parser: str | None = None
    # vLLM's speculative_config dict (or a SpeculativeConfig); None: no speculative decoding.
    speculative_config: Any = None
    # vLLM's names: ranks per pipeline stage, stages, and what runs the ranks (see llmhal.executor).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadReport:
    """What was built, for summaries and ``llmhal bench``."""

    model_path: str
    architecture: str
    dtype: torch.dtype
    quantization: str | None
    attention_backends: list[str]
    weight_bytes: int  # every rank's together, as kv_cache_bytes
    kv_cache_bytes: int  # every rank's together (see kv_cache_bytes_per_token)
    num_blocks: int
    load_seconds: float
    # Sequences of max_model_len tokens that fit at once (KV blocks, state slots, max_num_seqs).
    max_concurrency: int | None = None
    num_state_slots: int = 0  # recurrent layers' state cache (0: none)
    kv_cache_dtype: str = "auto"
    # What one token's keys and values take in the paged cache, every attention layer together (the
    # formula is llmhal.attention.kv_formats.kv_bytes_per_token; recurrent state is per request).
    # With several ranks, what they hold together: pipeline stages add up to the formula, and so do
    # tensor-parallel ranks splitting KV heads; a cache each rank holds whole (MLA's latent, KV
    # heads fewer than the ranks) counts once per rank that holds it.
    kv_cache_bytes_per_token: int = 0


def resolve_dtype(
    requested: str | torch.dtype, hf_config: Any, platform: Any, is_gguf: bool
) -> torch.dtype:
    """ "auto" keeps the checkpoint's dtype where the platform runs it well, else float32.

    GGUF files compute in float32 outside their quantized matmuls (as llama.cpp and transformers do),
    except on a platform that declares fast half-precision matmuls (``fast_bf16_matmul``): there they
    compute in its preferred half dtype (the first of ``supported_dtypes``), as vLLM runs GGUF on GPUs,
    so a vendor's bf16-only backend is not passed over for float32 reference code.
    bf16/fp16 checkpoints fall back to float32 on platforms without fast half-precision matmuls.
    """
    if isinstance(requested, torch.dtype):
        dtype = requested
    elif requested != "auto":
        if requested.lower() not in _DTYPES:
            raise ValueError(
                f"dtype={requested!r} is not known; use auto, {', '.join(sorted(set(_DTYPES)))}"
            )
        dtype = _DTYPES[requested.lower()]
    else:
        # transformers 5 names it ``dtype``; older configs keep ``torch_dtype`` (read without the
        # deprecated property, which warns).
        ckpt = getattr(hf_config, "dtype", None) or vars(hf_config).get("torch_dtype")
        if isinstance(ckpt, str):
            ckpt = _DTYPES.get(ckpt.removeprefix("torch."), torch.float32)
        dtype = torch.float32 if is_gguf or ckpt is None else ckpt
        fast_half = platform.capabilities.fast_bf16_matmul
        if is_gguf and fast_half:
            dtype = _preferred_half(platform) or dtype
            logger.info("dtype=auto: the GGUF model computes in %s (fast on this platform)", dtype)
        if dtype in (torch.bfloat16, torch.float16) and not fast_half:
            logger.info(
                "dtype=auto: %s checkpoint runs in float32 (no fast half-precision matmul here)",
                dtype,
            )
            dtype = torch.float32
        if dtype not in platform.supported_dtypes:
            dtype = platform.supported_dtypes[0]
    platform.verify_dtype(dtype)
    return dtype


def _preferred_half(platform: Any) -> torch.dtype | None:
    return next(
        (d for d in platform.supported_dtypes if d in (torch.bfloat16, torch.float16)), None
    )


def derive_max_model_len(hf_config: Any, requested: int | None) -> int:
    """The context length: ``requested``, or the model's ``max_position_embeddings`` (2048 when
    the config has none, which then sets no upper limit).

    RoPE scaling that extends the context (``linear``, ``dynamic``, ``yarn``: the factor times the
    original length, as vLLM counts it) raises the limit a request may ask for, not the default:
    ``dynamic`` scaling changes every position's rotation once the engine's context passes the
    original one, so the extended context is opt-in.
    """
    from llmhal.layers.rotary_embedding import rope_parameters

    declared = getattr(hf_config, "max_position_embeddings", None)
    native = declared or 2048
    limit, why = native, f"the model's max_position_embeddings ({native})"
    rope = rope_parameters(hf_config)
    factor = rope.get("factor")
    if factor and factor > 1 and rope["rope_type"] in ("linear", "dynamic", "yarn"):
        original = rope.get("original_max_position_embeddings") or native
        limit = int(original * factor)
        why = f"{rope['rope_type']} RoPE scaling's limit ({original} x {factor:g} = {limit})"
    if requested is None:
        return int(native)
    # A config that declares no limit (state-space models: no positions at all) takes any length.
    if requested > limit and declared:
        raise ValueError(f"max_model_len={requested} exceeds {why}; use at most {limit}")
    if requested < 2:
        raise ValueError(f"max_model_len must be at least 2, got {requested}")
    return requested


def process_weights_after_loading(model: torch.nn.Module) -> None:
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def _check_counts(args: EngineArgs) -> None:
    """Sizes that must be positive integers, named before anything loads (0 or -1 failed at the
    load-time warm-up as "the scheduler made no progress", or as a ZeroDivisionError)."""
    for name in ("max_num_seqs", "block_size", "max_num_batched_tokens", "kv_cache_memory_bytes",
                 "max_model_len"):  # fmt: skip
        value = getattr(args, name)
        optional = name not in ("max_num_seqs", "block_size")
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{name} must be a positive integer{' or None' if optional else ''}, got {value!r}"
            )
    budget = args.max_num_batched_tokens
    if budget is not None and budget < args.max_num_seqs:
        # Every running request needs a token of each step's budget: a smaller one would leave
        # admitted requests idle (vLLM refuses it too).
        raise ValueError(
            f"max_num_batched_tokens ({budget}) must be at least max_num_seqs "
            f"({args.max_num_seqs}); raise it or lower max_num_seqs"
        )


def build_engine(args: EngineArgs) -> tuple[Any, LoadReport]:
    """Build an :class:`~llmhal.engine.llm_engine.LLMEngine` (and a report of what was built)."""
    from llmhal.attention.kv_formats import canonical_kv_cache_dtype
    from llmhal.attention.state import check_mamba_cache_dtypes
    from llmhal.default_model import default_model_path
    from llmhal.model_loader.source import resolve_source
    from llmhal.platforms import get_current_platform
    from llmhal.plugins import load_general_plugins

    _check_counts(args)
    args.kv_cache_dtype = canonical_kv_cache_dtype(args.kv_cache_dtype)
    check_mamba_cache_dtypes(
        args.mamba_cache_dtype, args.mamba_ssm_cache_dtype, get_current_platform()
    )
    t0 = time.perf_counter()
    load_general_plugins()  # before the speculative config: a plugin may register its method
    if args.speculative_config is not None:
        from llmhal.spec_decode.config import SpeculativeConfig

        args.speculative_config = SpeculativeConfig.from_dict(args.speculative_config)
    platform = get_current_platform()
    source = resolve_source(args.model or default_model_path())
    progress = LoadProgress(source.path.name, args.load_progress)
    try:
        engine, report = _build(args, platform, source, progress, t0)
    except BaseException:
        progress.abandon()
        raise
    what = report.quantization or str(report.dtype).removeprefix("torch.")
    progress.finish(f"{what}, {report.weight_bytes / 2**20:.1f} MiB of weights")
    logger.info("Engine ready: %s", report)
    return engine, report


def resolve_engine_config(
    args: EngineArgs, platform: Any, source: Any
) -> tuple[EngineConfig, Any, Any]:
    """Everything decided before a weight loads: (config, the opened checkpoint, the model class).
    Every rank of a parallel engine runs this on the same arguments and gets the same config."""
    from llmhal.executor import resolve_parallel
    from llmhal.model_loader.checkpoint import open_checkpoint
    from llmhal.model_loader.source import GGUF
    from llmhal.models.registry import ModelRegistry
    from llmhal.quantization.resolve import resolve_quantization

    parallel = resolve_parallel(
        args.tensor_parallel_size, args.pipeline_parallel_size, args.distributed_executor_backend
    )
    ckpt = open_checkpoint(source)
    hf_config = ckpt.hf_config
    model_cls, arch = ModelRegistry.resolve_model_cls(
        getattr(hf_config, "architectures", None) or []
    )
    if parallel.pipeline_parallel_size > 1 and not getattr(model_cls, "supports_pp", False):
        raise ValueError(
            f"{arch} does not split into pipeline stages; use pipeline_parallel_size=1 (tensor "
            f"parallelism, tensor_parallel_size, may still apply)"
        )
    dtype = resolve_dtype(args.dtype, hf_config, platform, source.kind == GGUF)
    quant_name, quant_config = resolve_quantization(
        ckpt.quant_method,
        ckpt.quant_config_dict,
        args.quantization,
        platform,
        dtype,
        ckpt.build_quant_config,
    )
    max_len = derive_max_model_len(hf_config, args.max_model_len)
    batched = args.max_num_batched_tokens
    if batched is None:
        batched = max(2048, min(max_len, 8192))
    config = EngineConfig(
        model=ModelConfig(
            model=str(source.path), hf_config=hf_config, dtype=dtype, architecture=arch, max_model_len=max_len,
            quantization=quant_name, gguf_file=source.gguf_file, tokenizer=args.tokenizer, seed=args.seed,
            enforce_eager=args.enforce_eager,
        ),
        cache=CacheConfig(
            block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            enable_prefix_caching=args.enable_prefix_caching, mamba_cache_dtype=args.mamba_cache_dtype,
            mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        ),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=batched),
        attention_backend=args.attention_backend,
        quant_config=quant_config,
        device=None,
        structured_outputs_backend=args.structured_outputs_backend,
        structured_outputs_reasoning_parser=args.structured_outputs_reasoning_parser,
        speculative_config=args.speculative_config,
        parallel=parallel,
        extra=dict(args.extra),
    )  # fmt: skip
    # The platform may adjust the config (block size, cache dtype, ...): from here on every value
    # comes from `config`, not `args`, so the KV cache, its manager and the runner agree.
    platform.check_and_update_config(config)
    config.device = config.device or platform.torch_device()
    return config, ckpt, model_cls


def load_model(
    config: EngineConfig, ckpt: Any, model_cls: Any, progress: LoadProgress | None = None
) -> Any:
    """Build this process's model (its shard, when distributed is initialized), load its weights
    and return its :class:`~llmhal.engine.model_runner.ModelRunner` (``runner.model``)."""
    from llmhal.engine.model_runner import ModelRunner

    with set_current_config(config), torch.device(config.device):
        model = model_cls(config.model.hf_config)
    model.eval()
    with set_current_config(config), torch.no_grad():
        weights = ckpt.weights(progress)
        if config.quant_config is not None:  # formats whose names need mapping (bitsandbytes)
            weights = config.quant_config.map_checkpoint_weights(weights)
        loaded = model.load_weights(weights)
        _check_all_loaded(model, loaded)
        if progress is not None:
            progress.stage("preparing weights for the kernels")
        process_weights_after_loading(model)
    return ModelRunner(config, model, config.device)


def kv_cache_budget(config: EngineConfig, runner: Any, platform: Any) -> int:
    """This process's KV-cache bytes: ``kv_cache_memory_bytes`` per rank, as in vLLM, else the
    platform's budget after this rank's weights."""
    budget = config.cache.kv_cache_memory_bytes
    return platform.kv_cache_memory_budget(runner.weight_bytes()) if budget is None else budget


def kv_blocks_fitting(config: EngineConfig, runner: Any, platform: Any) -> int:
    """KV-cache blocks this process's budget (:func:`kv_cache_budget`) holds."""
    # beside the recurrent layers' states, if any
    return int(runner.blocks_fitting(kv_cache_budget(config, runner, platform)))


def _build(
    args: EngineArgs, platform: Any, source: Any, progress: LoadProgress, t0: float
) -> tuple[Any, LoadReport]:
    from llmhal.engine.llm_engine import LLMEngine
    from llmhal.engine.state_cache import make_cache_manager
    from llmhal.executor import make_executor

    progress.stage("config")
    config, ckpt, model_cls = resolve_engine_config(args, platform, source)
    proposer = _make_proposer(config)  # its settings are checked before any weight loads
    if getattr(proposer, "drafts_trees", False):
        _choose_tree_attention(config)
    spec = config.speculative_config
    if spec is not None and config.parallel.world_size > 1 and spec.method not in ("ngram", "suffix"):  # fmt: skip
        # Drafting runs in rank 0 only; a method with a model of its own (or reading the
        # target's layers) would build or see one rank's shard.
        raise ValueError(
            f"speculative method {spec.method!r} does not run with tensor_parallel_size x "
            f"pipeline_parallel_size = {config.parallel.world_size}; use 'ngram' or 'suffix' "
            "(they draft from the tokens alone), or one rank"
        )
    platform.seed(args.seed)
    progress.stage("tokenizer")
    tokenizer = ckpt.tokenizer(args.tokenizer)
    config.extra.setdefault("generation_eos_token_ids", ckpt.generation_eos_token_ids())
    config.extra.setdefault("generation_defaults", ckpt.generation_defaults())

    executor = make_executor(config, args)
    try:
        # Other ranks (if any) start and load their shards while this process loads its own.
        executor.initialize(lambda: load_model(config, ckpt, model_cls, progress))
        runner = executor.runner
        model = runner.model
        _check_prefix_caching(config, runner)
        _warn_slow_paths(runner, platform)
        speculator = None
        if proposer is not None:
            from llmhal.spec_decode.speculator import Speculator

            proposer.load_model(model)
            speculator = Speculator(config.speculative_config, proposer, config.model.max_model_len)
            if speculator.wants_hidden:  # EAGLE-style heads read the target's hidden states
                runner.capture_hidden = True
                speculator.runner = runner
            if getattr(proposer, "drafts_trees", False):  # the runner builds their masks
                runner.draft_trees = speculator.trees
                speculator.runner = runner
        num_blocks = executor.determine_num_blocks()  # the fewest any rank holds
        if num_blocks < 1:
            budget = kv_cache_budget(config, runner, platform)
            raise ValueError(
                f"The KV-cache budget ({budget} bytes) is smaller than one block "
                f"({runner.kv_cache_bytes_per_block()} bytes for "
                f"block_size={config.cache.block_size}); raise kv_cache_memory_bytes."
            )
        config.cache.num_blocks = num_blocks
        progress.stage("KV cache")
        executor.allocate(num_blocks)
        kv = make_cache_manager(
            num_blocks, config.cache.block_size, runner.num_state_slots,
            config.cache.enable_prefix_caching,
        )  # fmt: skip
        runner.state_cache = kv  # the runner asks it for each request's state slot
        concurrency = _log_concurrency(config, runner)
        engine = LLMEngine(config, model, tokenizer, platform, executor, kv, speculator)
        progress.stage("warming up")
        engine.warmup()
    except BaseException:
        executor.shutdown()
        raise
    report = LoadReport(
        str(source.path), config.model.architecture, config.model.dtype, config.model.quantization,
        runner.attention_backends, executor.memory.weight_bytes, executor.memory.kv_bytes, num_blocks,
        time.perf_counter() - t0, concurrency, runner.num_state_slots, config.cache.kv_cache_dtype,
        executor.memory.kv_bytes_per_block // config.cache.block_size,
    )  # fmt: skip
    return engine, report


def _make_proposer(config: EngineConfig) -> Any:
    """The speculative config's proposer (None without one), built before weights load."""
    spec = config.speculative_config
    if spec is None:
        return None
    from llmhal.spec_decode.registry import get_proposer_cls

    if spec.max_model_len is not None and spec.max_model_len > config.model.max_model_len:
        raise ValueError(
            f"speculative_config['max_model_len']={spec.max_model_len} exceeds the target's "
            f"max_model_len ({config.model.max_model_len}); lower it or leave it out"
        )
    return get_proposer_cls(spec.method)(spec, config)


def _choose_tree_attention(config: EngineConfig) -> None:
    """Draft trees are verified in one forward: the model's attention layers ask the registry for
    a backend of kind ``tree`` (``tree_attn`` in core), which gives requests without a tree the
    causal rule. An explicit choice of another kind is refused here, with the remedy."""
    import os

    from llmhal.attention.registry import list_attention_backends, normalize

    chosen = config.attention_backend or os.environ.get("VLLM_ATTENTION_BACKEND", "").strip()
    kinds = {e.name: e.kind for e in list_attention_backends()}
    if chosen and kinds.get(normalize(chosen), "tree") != "tree":
        trees = sorted(n for n, k in kinds.items() if k == "tree")
        raise ValueError(
            f"speculative method {config.speculative_config.method!r} verifies draft trees, "
            f"which needs an attention backend of kind 'tree' ({', '.join(trees)}), but "
            f"{chosen!r} was chosen; unset attention_backend / VLLM_ATTENTION_BACKEND, or draft "
            "a chain (e.g. Medusa's medusa_choices with top-1 paths only)"
        )
    config.extra["draft_trees"] = True


def _check_prefix_caching(config: EngineConfig, runner: Any) -> None:
    """Prefix caching skips computing cached tokens, which is only sound where a token's state is
    its own KV rows; a recurrent layer (Mamba, linear attention, ...) carries state across every
    token, so such a model runs without it, as in vLLM."""
    layers = [*runner.layers, *getattr(runner, "state_layers", [])]
    kinds = {layer.requirements.kind for layer in layers} - {"mha", "mla", "tree"}
    if config.cache.enable_prefix_caching and kinds:
        logger.info(
            "Prefix caching is off: the model has %s layers, whose state after a prefix is not "
            "kept (only keys and values are cached per block)",
            ", ".join(sorted(kinds)),
        )
        config.cache.enable_prefix_caching = False
    if kinds and config.speculative_config is not None:
        # Verifying drafts advances a recurrent state over tokens that may be rejected, and a
        # state cannot be rolled back.
        raise ValueError(
            f"Speculative decoding is not supported for models with {', '.join(sorted(kinds))} "
            "layers (their state cannot be rolled back past rejected drafts); drop "
            "speculative_config"
        )


def _log_concurrency(config: EngineConfig, runner: Any) -> int:
    """How many sequences fit at once: the state slots (recurrent layers) and the KV blocks
    (attention layers) at the full context length, whichever is fewer; at most max_num_seqs."""
    limits = [config.scheduler.max_num_seqs]
    why = [f"max_num_seqs={limits[0]}"]
    if getattr(runner, "state_layers", None):
        limits.append(runner.num_state_slots)
        why.append(f"{runner.num_state_slots} state slots")
    if runner.layers:
        per_seq = -(-config.model.max_model_len // config.cache.block_size)
        limits.append(config.cache.num_blocks // per_seq)
        why.append(f"{config.cache.num_blocks} KV blocks hold {limits[-1]} full contexts")
    logger.info(
        "Maximum concurrency for %d-token requests: %d sequences (%s)",
        config.model.max_model_len, min(limits), ", ".join(why),
    )  # fmt: skip
    return min(limits)


def _warn_slow_paths(runner: Any, platform: Any) -> None:
    """Say so when attention or an op runs core's pure-torch reference (no silent slow path)."""
    from llmhal.engine.slow_paths import slow_path_notes

    layers = [*runner.layers, *getattr(runner, "state_layers", ())]
    for note in slow_path_notes([layer.selection for layer in layers], platform):
        logger.warning("Slow path: %s", note)


def _check_all_loaded(model: torch.nn.Module, loaded: set[str] | None) -> None:
    if loaded is None:
        return
    expected = {name for name, _ in model.named_parameters()}
    missing = sorted(expected - set(loaded))
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise ValueError(f"The checkpoint has no tensors for these model parameters: {shown}")
