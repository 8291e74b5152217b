"""``LLM``: the offline batch API (vLLM-compatible in shape)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from llmhal.engine.builder import EngineArgs, build_engine
from llmhal.engine.chat import normalize_chat_messages
from llmhal.engine.outputs import RequestOutput
from llmhal.engine.sampling_params import SamplingParams
from llmhal.engine.scheduler import POLICIES, check_priority

Prompt = str | dict[str, Any]


class LLM:
    """Load a model on the current platform and generate from it.

    ``model`` is a local folder (config.json + safetensors) or a .gguf file; None uses the default
    model (SmolLM2-135M-Instruct). ``kv_cache_memory_bytes`` sizes the KV cache explicitly; otherwise
    the platform's memory budget does. ``enforce_eager=True`` runs every step through Python, never
    replaying a recorded decode step (see :mod:`llmhal.engine.decode_graphs`). ``load_progress``
    shows the loading stages on stderr (default: only when stderr is a terminal).
    ``structured_outputs_config={"backend": "auto" | "xgrammar" | "guidance"}`` (vLLM's) picks what
    compiles requests' ``SamplingParams(structured_outputs=...)``; see
    :mod:`llmhal.structured_output.manager`. With ``"reasoning_parser": name`` there too, a
    constrained request reasons freely first: its grammar starts once the parser sees the
    reasoning end (vLLM's behaviour; the model's vocabulary must have the parser's tags).
    ``enable_prefix_caching`` (default on, as in vLLM) lets a request reuse the KV cache of the
    leading tokens it shares with earlier ones (a system prompt, a conversation's history, its own
    tokens after preemption); a prompt dict's ``"cache_salt"`` keeps requests with different
    salts apart. :meth:`reset_prefix_cache` forgets what is cached.
    ``speculative_config`` (vLLM's dict, e.g. ``{"method": "ngram", "num_speculative_tokens": 4}``)
    turns on speculative decoding (see :mod:`llmhal.spec_decode`); output stays the same.
    ``pooler_config`` (vLLM's, a dict or :class:`llmhal.pooling.PoolerConfig`: ``pooling_type``
    LAST/MEAN/CLS/ALL, ``normalize``, ``dimensions``) sets how :meth:`embed`, :meth:`encode` and
    :meth:`score` pool. ``io_processor_plugin`` names an IO processor (a
    ``vllm.io_processor_plugins`` entry point or a built-in, see :mod:`llmhal.pooling.io_processor`)
    that ``encode({"data": ...})`` and the server's ``/pooling`` with ``data`` go through.
    ``scheduling_policy`` (vLLM's): ``"fcfs"`` (default) runs requests by arrival;
    ``"priority"`` by each request's priority (``generate(priority=[...])``, lower first, ties by
    arrival), preempting the lowest when the KV cache runs out.
    ``mamba_cache_dtype`` and ``mamba_ssm_cache_dtype`` (vLLM's): where recurrent layers keep their
    states: the first sets conv and SSM states (and linear attention's), ``"auto"`` = the model's
    dtype; the second the SSM state alone, ``"auto"`` = the first (``"float32"``, ``"bfloat16"``,
    ``"float16"`` where the platform's kernels serve it; docs/state-space-models.md).

    Of vLLM's other engine arguments, ``trust_remote_code`` and ``disable_log_stats`` are accepted
    and change nothing (llmhal never runs a checkpoint's own code, and logs no per-step stats).
    ``tensor_parallel_size`` and ``pipeline_parallel_size`` split the model over that many ranks
    (their product), run by ``distributed_executor_backend``: ``"mp"`` (local processes, the
    default for more than one rank), ``"ray"``, ``"external_launcher"`` (one ``torchrun`` process
    per rank, each running this LLM) or ``"uni"`` (one rank); see docs/distributed.md and
    :meth:`shutdown`. Any other keyword is a TypeError naming it:
    silently ignoring one (``gpu_memory_utilization``, ``enable_lora``, ...) would run something
    other than what was asked for.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        attention_backend: str | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        mamba_cache_dtype: str = "auto",
        mamba_ssm_cache_dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        kv_cache_memory_bytes: int | None = None,
        enable_prefix_caching: bool | None = None,
        seed: int = 0,
        enforce_eager: bool = False,
        load_progress: bool | None = None,
        structured_outputs_config: dict[str, Any] | None = None,
        speculative_config: dict[str, Any] | None = None,
        pooler_config: Any = None,
        io_processor_plugin: str | None = None,
        scheduling_policy: str = "fcfs",
        trust_remote_code: bool = False,
        disable_log_stats: bool = True,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise TypeError(
                f"LLM() got keyword argument(s) llmhal does not support: {', '.join(sorted(unknown))}"
                "; see help(llmhal.LLM) for the ones it takes"
            )
        from llmhal.executor import resolve_parallel

        # Checked before the model loads (an unknown backend, a size of 0).
        resolve_parallel(tensor_parallel_size, pipeline_parallel_size, distributed_executor_backend)
        so_backend, so_reasoning = _structured_outputs_config(structured_outputs_config)
        from llmhal.pooling.params import PoolerConfig

        pooling = PoolerConfig.parse(pooler_config)  # checked before the model loads
        if scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy {scheduling_policy!r} is not one of {', '.join(POLICIES)} (vLLM's)")  # fmt: skip
        # torchrun's other ranks (external_launcher) never import process-0-only plugins.
        other_rank = distributed_executor_backend == "external_launcher" and os.environ.get("RANK", "0") != "0"  # fmt: skip
        if io_processor_plugin is not None and not other_rank:
            from llmhal.pooling.io_processor import find_io_processor

            find_io_processor(io_processor_plugin)  # an unknown name fails before the model loads
        args = EngineArgs(
            model=model, tokenizer=tokenizer, dtype=dtype, attention_backend=attention_backend,
            quantization=quantization, kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
            mamba_cache_dtype=mamba_cache_dtype, mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes, seed=seed, enforce_eager=enforce_eager,
            enable_prefix_caching=True if enable_prefix_caching is None else bool(enable_prefix_caching),
            load_progress=load_progress, structured_outputs_backend=so_backend,
            structured_outputs_reasoning_parser=so_reasoning, speculative_config=speculative_config,
            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            distributed_executor_backend=distributed_executor_backend,
        )  # fmt: skip
        self.engine, self.load_report = build_engine(args)
        self.engine.pooler_config = pooling
        self.engine.scheduler.set_policy(scheduling_policy)
        from llmhal.pooling.io_processor import load_io_processor

        # Process 0 only (vLLM's rule): this process owns the requests. (With an external
        # launcher every rank runs an LLM; the others get none.)
        first = self.engine.config.parallel.rank == 0
        self.io_processor = (
            load_io_processor(self.engine.config, io_processor_plugin) if first else None
        )

    def shutdown(self) -> None:
        """Stop the engine's other processes now (they are also stopped when this process
        exits); the LLM cannot generate afterwards."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's): True when done, False (nothing forgotten) while
        requests are running."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given no SamplingParams (vLLM's rule): the
        model's generation_config.json settings (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens as max_tokens) over SamplingParams' defaults."""
        defaults = self.engine.config.extra.get("generation_defaults") or {}
        try:
            return SamplingParams(**defaults)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"the model's generation_config.json has settings SamplingParams refuses ({e}); "
                f"pass sampling_params explicitly"
            ) from None

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        Every prompt is validated before any work starts, so a bad one (e.g. longer than the model's
        context) raises without side effects and the LLM stays usable. ``use_tqdm`` (vLLM's): a
        progress bar of finished prompts on stderr, when it is a terminal; a callable is used as
        the tqdm class; False hides it. ``priority`` (vLLM's): one integer per prompt, lower
        first, with ``LLM(scheduling_policy="priority")``.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        engine = self.engine
        for p in priorities:
            check_priority(p, engine.scheduler.policy)
        # n > 1: n requests of one completion each (vLLM's parallel sampling), joined below. Every
        # child's parameters are built (and so checked) before any request is added.
        children = [p.children() for p in params]
        # Tokenized once: the requests below (n per prompt) get the ids, not the text again.
        # Every request (each child of each prompt) is prepared, so validated and its grammar
        # compiled, before any is added.
        prepared = []
        for prompt, kids in zip(prompts, children, strict=True):
            text, ids = engine.tokenize(prompt)
            inp = {"prompt": text, "prompt_token_ids": ids}
            if isinstance(prompt, dict) and "cache_salt" in prompt:
                inp["cache_salt"] = prompt["cache_salt"]
            prepared.append([engine.prepare_request(inp, c) for c in kids])
        for prep in (p for g in prepared for p in g):  # compiled together, on the manager's threads
            prep.wait_for_grammar()
        groups = [[engine.add_request(prep, priority=p) for prep in g] for g, p in zip(prepared, priorities, strict=True)]  # fmt: skip
        owner = {rid: gi for gi, g in enumerate(groups) for rid in g}
        left = [len(g) for g in groups]  # completions each prompt still waits for
        final: dict[str, RequestOutput] = {}
        bar = _progress_bar(use_tqdm, len(groups))
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        left[owner[out.request_id]] -= 1
                        if bar is not None and not left[owner[out.request_id]]:
                            bar.update(1)
        except BaseException:
            for rid in (r for g in groups for r in g):
                engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [_joined([final[r] for r in g]) for g in groups]

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: Any = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_task: str | None = None,
    ) -> list[Any]:
        """Pool each prompt's final hidden states (vLLM's): ``pooling_task="embed"`` gives one
        vector per prompt, ``"token_embed"`` one per token; ``list[PoolingRequestOutput]`` whose
        ``outputs.data`` is a tensor. See :mod:`llmhal.pooling`."""
        from llmhal.pooling import offline

        bar = lambda n: _progress_bar(use_tqdm, n)  # noqa: E731
        return offline.encode(self, prompts, pooling_params, pooling_task, bar)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: Any = None,
    ) -> list[Any]:
        """One embedding per prompt (vLLM's ``list[EmbeddingRequestOutput]``, ``outputs.embedding``
        a list of floats), pooled per ``pooler_config`` and the PoolingParams."""
        from llmhal.pooling import offline

        return offline.embed(self, prompts, pooling_params, lambda n: _progress_bar(use_tqdm, n))

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: Any = None,
    ) -> list[Any]:
        """A sequence classifier's class probabilities per prompt (vLLM's
        ``list[ClassificationRequestOutput]``, ``outputs.probs`` one per label); the model must
        be a ``*ForSequenceClassification`` checkpoint (see :mod:`llmhal.models.seq_cls`)."""
        from llmhal.pooling import offline

        return offline.classify(self, prompts, pooling_params, lambda n: _progress_bar(use_tqdm, n))

    def score(
        self,
        data_1: Prompt | Sequence[Prompt],
        data_2: Prompt | Sequence[Prompt],
        /,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: Any = None,
    ) -> list[Any]:
        """The cosine similarity of the texts' embeddings (vLLM's bi-encoder score): 1 text with
        1, 1 with N or N with N; ``list[ScoringRequestOutput]`` with ``outputs.score``."""
        from llmhal.pooling import offline

        bar = lambda n: _progress_bar(use_tqdm, n)  # noqa: E731
        return offline.score(self, data_1, data_2, pooling_params, bar)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        tok = self.engine.tokenizer
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError(
                "This model's tokenizer has no chat template; pass chat_template=..., or use "
                "generate() with a plain prompt"
            )
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message=True extends the last message; it needs "
                "add_generation_prompt=False"
            )
        from jinja2 import TemplateError

        try:
            return tok.apply_chat_template(
                normalize_chat_messages(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                tools=tools,
                **(chat_template_kwargs or {}),
            )
        except TemplateError as e:  # raise_exception() in a template: these messages are refused
            raise ValueError(f"the chat template refused these messages: {e}") from None

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (or ``chat_template``) to one conversation or a list of
        them, and generate; the arguments are vLLM's. Message content may be a string or a list of
        text parts (see :func:`~llmhal.engine.chat.normalize_chat_messages`)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.chat_prompt(
                conv,  # type: ignore[arg-type]
                add_generation_prompt,
                chat_template=chat_template,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
            for conv in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> dict[str, Any]:
        """One conversation as a prompt dict for :meth:`generate`: the templated text and its
        token ids (``kwargs`` as :meth:`apply_chat_template` takes them)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        # The template already holds the special tokens; do not let encode() add a second BOS.
        ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": ids}


def _structured_outputs_config(config: dict[str, Any] | None) -> tuple[str, str | None]:
    """(backend, reasoning parser) of vLLM's ``structured_outputs_config`` (``{"backend": ...,
    "reasoning_parser": ...}``), checked before the model loads."""
    from llmhal.reasoning.manager import ReasoningParserManager
    from llmhal.structured_output.manager import check_backend_name

    if config is None:
        return "auto", None
    if not isinstance(config, dict) or set(config) - {"backend", "reasoning_parser"}:
        raise ValueError(
            "structured_outputs_config takes {'backend': name, 'reasoning_parser': name} in "
            f"llmhal, got {config!r}"
        )
    reasoning = config.get("reasoning_parser")
    if reasoning is not None:
        ReasoningParserManager.get_reasoning_parser(reasoning)  # KeyError naming the known ones
    return check_backend_name(config.get("backend", "auto")), reasoning


def _joined(outs: list[RequestOutput]) -> RequestOutput:
    """One prompt's n completions as one output (vLLM's shape): the first request's output with
    every completion in ``outputs``, indexed 0..n-1."""
    if len(outs) == 1:
        return outs[0]
    completions = [dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(outs)]
    return dataclasses.replace(outs[0], outputs=completions)


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int) -> Any:
    """vLLM's "Processed prompts" bar, shown only on a terminal (logs and pipes stay clean)."""
    from llmhal.model_loader.progress import stderr_is_terminal

    if not use_tqdm or not stderr_is_terminal():
        return None
    if callable(use_tqdm):
        cls = use_tqdm
    else:
        from tqdm import tqdm as cls
    return cls(total=total, desc="Processed prompts", unit="prompt")
