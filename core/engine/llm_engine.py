"""The engine loop: admit requests, schedule a step, run it, sample, detokenize, stop.

``LLMEngine`` is the streaming core; :class:`llmhal.engine.llm.LLM` wraps it for batch use.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llmhal.config import EngineConfig
from llmhal.engine.detokenizer import IncrementalDetokenizer
from llmhal.engine.kv_cache_manager import KVCacheManager
from llmhal.engine.model_runner import ModelRunner
from llmhal.engine.outputs import Logprob, RequestMetrics, RequestOutput
from llmhal.engine.request import Request, RequestStatus, TokenView
from llmhal.engine.sampler import Sampler
from llmhal.engine.sampling_params import SamplingParams
from llmhal.engine.scheduler import ScheduledBatch, Scheduler, check_priority
from llmhal.engine.stat_loggers import (
    FinishedRequestStats,
    IterationStats,
    PrefixCacheStats,
    SchedulerStats,
    load_stat_loggers,
    record_all,
)
from llmhal.engine.step_budget import DecodePace
from llmhal.logger import init_logger
from llmhal.pooling.params import PoolingParams
from llmhal.structured_output.manager import PendingGrammar, StructuredOutputManager

logger = init_logger(__name__)


@dataclass
class EngineStats:
    """Token counts and wall time, split by step kind, for tokens/s summaries."""

    prefill_tokens: int = 0  # prompt tokens computed (not those taken from the prefix cache)
    prefill_seconds: float = 0.0
    cached_prompt_tokens: int = 0  # prompt tokens taken from the prefix cache instead
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    steps: int = 0
    preemptions: int = 0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


# The most top log-probabilities a request may ask for per token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


# The warm-up request's id: stat loggers see its steps (they run at load, before any user request).
WARMUP_REQUEST_ID = "__warmup__"
# Bad words' token sequences per request, in all (vLLM's newest limit).
MAX_BAD_WORD_TOKENS = 1024


@dataclass
class PreparedRequest:
    """A tokenized, validated request, ready for :meth:`LLMEngine.add_request`."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    grammar: Any  # a PendingGrammar (its constraint compiling off the engine's path), or None
    arrival_time: float
    bad_words_token_ids: list[list[int]]
    cache_salt: str | None = None
    pooling: Any = None  # a pooling request's ResolvedPooling (llmhal.pooling); None: generate

    def wait_for_grammar(self, timeout: float | None = None) -> None:
        """Wait until the request's constraint is compiled; ValueError if it cannot be."""
        if self.grammar is not None:
            self.grammar.result(timeout)


def _cache_salt(prompt: str | dict[str, Any]) -> str | None:
    """A prompt dict's ``cache_salt`` (vLLM's): requests share cached prefixes only with requests
    that carry the same salt."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        tokenizer: Any,
        platform: Any,
        executor: Any,
        kv: KVCacheManager,
        speculator: Any = None,
    ) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.platform = platform
        # A llmhal.executor Executor: runs each step on every rank; its runner is this process's.
        self.executor = executor
        self.runner: ModelRunner = executor.runner
        self.kv = kv
        sched = config.scheduler
        # Measured step costs; they limit prefill while requests decode when the factor is set.
        self.pace = DecodePace(sched.decode_pace_factor)
        self.scheduler = Scheduler(
            kv,
            sched.max_num_seqs,
            sched.max_num_batched_tokens,
            sched.enable_chunked_prefill,
            self.pace,
            graph_chunk_tokens=self.runner.graph_chunk_tokens,
        )
        self.sampler = Sampler(torch.Generator().manual_seed(config.model.seed))
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._arrivals = itertools.count()  # ties of equal priority go by this
        self._requests: dict[str, Request] = {}
        self.eos_token_ids = self._eos_ids()
        # Process 0 only (vLLM's rule): an external launcher's other ranks run this engine too.
        self.stat_loggers = load_stat_loggers(config) if config.parallel.rank == 0 else []
        self.pooler_config: Any = (
            None  # a llmhal.pooling.PoolerConfig (LLM sets it); None: defaults
        )
        # A llmhal.spec_decode.speculator.Speculator when a speculative config was given.
        self.speculator = speculator
        self._structured: StructuredOutputManager | None = None  # made on first use
        # Requests whose constraint is still compiling (vLLM's WAITING_FOR_FSM): the scheduler
        # gets them once it is done, and the running ones keep decoding meanwhile.
        self._compiling: list[Request] = []
        # structured_outputs_config's reasoning_parser: constrained requests reason freely first.
        self.reasoner = None
        if config.structured_outputs_reasoning_parser is not None:
            from llmhal.reasoning.manager import ReasoningParserManager

            parser = ReasoningParserManager.get_reasoning_parser(config.structured_outputs_reasoning_parser)  # fmt: skip
            self.reasoner = parser(tokenizer)  # a model without the parser's tags fails here
        self._structured_lock = threading.Lock()
        # Batches in flight through pipeline stages (llmhal.engine.batch_queue); made on first use.
        self._batch_queue: Any = None
        # A token's own text (special tokens included), for log-probability entries; one decode
        # per id. The server's OpenAI shapes use it too.
        self.token_text = functools.lru_cache(maxsize=65536)(
            lambda t: tokenizer.decode([t], skip_special_tokens=False)
        )

    def _eos_for(self, params: SamplingParams) -> frozenset[int]:
        """The EOS ids that end (and, under min_tokens, are banned from) a request with ``params``."""
        return frozenset() if params.ignore_eos else self.eos_token_ids

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (
            getattr(self.config.model.hf_config, "eos_token_id", None),
            getattr(self.tokenizer, "eos_token_id", None),
        ):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, list | tuple):
                ids.update(int(i) for i in src)
        gen_cfg = self.config.extra.get("generation_eos_token_ids")
        if gen_cfg:
            ids.update(gen_cfg)
        return frozenset(ids)

    # ------------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | dict[str, Any]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            other = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"})
            if other:  # e.g. vLLM's multi_modal_data: dropping it would answer another question
                raise ValueError(
                    f"a prompt dict takes 'prompt' and/or 'prompt_token_ids' (and 'cache_salt'); "
                    f"llmhal does not support {', '.join(map(repr, other))}"
                )
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        if not isinstance(prompt, str):
            raise TypeError(
                f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
            )
        return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)

    def structured_outputs(self) -> StructuredOutputManager:
        """The engine's structured-output manager (made on the first constrained request)."""
        with self._structured_lock:  # requests are prepared on the server's handler threads
            if self._structured is None:
                hf = self.config.model.hf_config
                vocab = getattr(hf, "vocab_size", None) or len(self.tokenizer)
                # vLLM's rule: with external_launcher every rank runs this engine and must
                # compile in step with the others, so compiles run on the caller's thread.
                launcher = self.config.parallel.distributed_executor_backend == "external_launcher"  # fmt: skip
                self._structured = StructuredOutputManager(
                    self.tokenizer,
                    vocab,
                    self.eos_token_ids,
                    self.config.structured_outputs_backend,
                    async_compile=not launcher,
                )
            return self._structured

    def bad_words_token_ids(self, words: Sequence[str] | None) -> list[list[int]]:
        """Each bad word's token sequences (vLLM's rule): as written (leading spaces stripped),
        and after a space when that is the same number of tokens with a different first one (the
        word inside a sentence; a longer form would be a space token and the word, already
        covered). ValueError past MAX_BAD_WORD_TOKENS tokens in all (each sequence is matched
        against the output at every step)."""
        seqs: list[list[int]] = []
        for word in words or ():
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            forms = [plain]
            if len(spaced) == len(plain) and spaced[:1] != plain[:1]:
                forms.append(spaced)
            seqs += [ids for ids in forms if ids and ids not in seqs]
        if sum(map(len, seqs)) > MAX_BAD_WORD_TOKENS:
            raise ValueError(
                f"bad_words come to more than {MAX_BAD_WORD_TOKENS} tokens; send fewer"
            )
        return seqs

    def _check(self, token_ids: Sequence[int], params: SamplingParams) -> tuple[int, Any]:
        """Validate a request before any work starts: (max_tokens resolved, the request's
        compiled grammar or None)."""
        limit = self.config.model.max_model_len
        n = len(token_ids)
        if n == 0:
            raise ValueError("The prompt is empty (0 tokens); give at least one token.")
        if n >= limit:
            own = getattr(self.config.model.hf_config, "max_position_embeddings", None)
            remedy = (
                "Shorten the prompt"
                if own is None or limit >= own
                else f"Shorten the prompt or raise max_model_len (up to the model's own {own})"
            )
            raise ValueError(
                f"The prompt is {n} tokens long, but the model's context is {limit} tokens "
                f"(max_model_len) and at least one must be left to generate. {remedy}."
            )
        vocab = getattr(self.config.model.hf_config, "vocab_size", None)
        if vocab is not None and any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt_token_ids contain ids outside the vocabulary [0, {vocab})")
        # Checked here, not inside a step: a step that fails takes every request in it down.
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > MAX_LOGPROBS:
                raise ValueError(
                    f"{name}={k}: at most {MAX_LOGPROBS} top log-probabilities per token"
                )
        allowed = params.allowed_token_ids
        if allowed is not None and params.min_tokens:
            # min_tokens bans these until then (the sampler's rule): with nothing else allowed,
            # no token could be sampled, and the step holding the request would fail.
            if set(allowed) <= self._eos_for(params) | set(params.stop_token_ids):
                raise ValueError(
                    f"allowed_token_ids {sorted(set(allowed))} are all stop or EOS tokens, which "
                    f"min_tokens={params.min_tokens} forbids at first; allow another token or set "
                    "min_tokens=0"
                )
        if vocab is not None:
            for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
                if any(t < 0 or t >= vocab for t in getattr(params, name) or ()):
                    raise ValueError(f"{name} contain ids outside the vocabulary [0, {vocab})")
        max_tokens = min(params.max_tokens or limit, limit - n)
        # The last sampled token is never fed back, so it never takes a KV slot.
        slots = n + max_tokens - 1
        need = self.kv.blocks_for(slots)
        if need > self.kv.num_blocks:
            raise ValueError(
                f"This request needs {slots} tokens of KV cache ({need} blocks of "
                f"{self.kv.block_size}) but the cache holds only {self.kv.capacity_tokens} tokens "
                f"({self.kv.num_blocks} blocks). Raise kv_cache_memory_bytes, or lower max_tokens."
            )
        grammar = None
        if params.structured_outputs is not None:  # compiling starts now, on the manager's threads
            grammar = self.structured_outputs().request(params.structured_outputs)
        return max_tokens, grammar

    def prepare_request(
        self,
        prompt: str | dict[str, Any],
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
    ) -> PreparedRequest:
        """Tokenize and validate a request (compiling its structured-output grammar) without
        touching the engine's state: callers may do this on their own threads, outside the lock
        that serialises steps. ``arrival_time`` (time.monotonic(); default now) starts its
        latencies. ``params`` may be a :class:`llmhal.pooling.PoolingParams`: the request is
        then prefilled only and answered with a PoolingRequestOutput (see llmhal.pooling)."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        salt = _cache_salt(prompt)
        text, ids = self.tokenize(prompt)
        if getattr(self.model, "pooling_only", False) and not isinstance(params, PoolingParams):
            raise ValueError(
                f"{self.config.model.architecture} is a classifier: it does not generate text; "
                "use LLM.classify / POST /classify (or LLM.embed for its hidden states)"
            )
        if isinstance(params, PoolingParams):
            from llmhal.pooling.requests import check_pooling_request

            pooling = check_pooling_request(self, ids, params)
            plain = SamplingParams(max_tokens=1)  # never sampled; the Request's fields need one
            return PreparedRequest(text, ids, plain, 0, None, arrival, [], salt, pooling)
        params = params or SamplingParams()
        max_tokens, grammar = self._check(ids, params)
        bad = self.bad_words_token_ids(params.bad_words)
        return PreparedRequest(text, ids, params, max_tokens, grammar, arrival, bad, salt)

    def add_request(
        self,
        prompt: str | dict[str, Any] | PreparedRequest,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request: a prompt with its params, or one :meth:`prepare_request` made.
        ``priority`` (vLLM's; lower runs first) needs the scheduler's ``priority`` policy."""
        check_priority(priority, self.scheduler.policy)
        if isinstance(prompt, PreparedRequest):
            if params is not None:
                raise ValueError("a prepared request carries its own SamplingParams")
            prep = prompt
        else:
            prep = self.prepare_request(prompt, params)
        text, ids, params, max_tokens = prep.prompt, prep.prompt_token_ids, prep.params, prep.max_tokens  # fmt: skip
        rid = request_id or str(next(self._ids))
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if prep.grammar is not None and prep.grammar.ready():
            prep.wait_for_grammar()  # compiled already (or cached): a failure is refused here
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        req = Request(
            request_id=rid,
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            max_tokens=max_tokens,
            eos_token_ids=self._eos_for(params),
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
            generator=gen,
            logprobs=[] if params.logprobs is not None else None,
            # The first prompt token has none: nothing before it predicts it (vLLM's shape).
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            grammar=prep.grammar,
            # Whether its reasoning is over (None: no reasoning gate): a prompt may end it already
            # (a template that turns thinking off writes the empty <think></think> itself).
            reasoning_ended=None
            if prep.grammar is None or self.reasoner is None
            else self.reasoner.is_reasoning_end(ids),
            bad_words_token_ids=prep.bad_words_token_ids,
            metrics=RequestMetrics(prep.arrival_time),
            cache_salt=prep.cache_salt,
            priority=priority,
            arrival_index=next(self._arrivals),
        )
        if prep.pooling is not None:
            from llmhal.pooling.pooler import PoolingState

            req.pooling = PoolingState(prep.pooling, len(ids))
        self._requests[rid] = req
        if prep.grammar is not None and not prep.grammar.ready():
            req.status = RequestStatus.WAITING_FOR_FSM
            self._compiling.append(req)
        else:
            self._admit(req)
        return rid

    def _admit(self, req: Request) -> RequestOutput | None:
        """Hand a request to the scheduler, its grammar compiled; a constraint that failed to
        compile ends the request alone ("abort", the reason logged) and returns its output."""
        if req.grammar is not None:
            try:
                req.grammar = req.grammar.result()
            except ValueError as e:
                logger.warning("request %s: its structured-output constraint failed: %s", req.request_id, e)  # fmt: skip
                req.metrics.finished_time = time.monotonic()
                req.status = RequestStatus.FINISHED_ABORTED
                self._requests.pop(req.request_id, None)
                return req.to_output(0)
        self.scheduler.add(req)
        return None

    def _admit_compiled(self, wait: bool) -> list[RequestOutput]:
        """Admit the requests whose constraint has compiled; ``wait``: nothing else can run, so
        wait (briefly) for one rather than spin."""
        if wait and not any(r.grammar.ready() for r in self._compiling):
            PendingGrammar.wait_any([r.grammar for r in self._compiling], 0.05)
        done = [r for r in self._compiling if r.grammar.ready()]
        self._compiling = [r for r in self._compiling if not r.grammar.ready()]
        return [out for r in done if (out := self._admit(r)) is not None]

    def abort_request(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None and req in self._compiling:
            self._compiling.remove(req)
            req.status = RequestStatus.FINISHED_ABORTED
            req.metrics.finished_time = time.monotonic()
        elif req is not None and not req.status.finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            if self.speculator is not None:
                self.speculator.finish(request_id)
            req.metrics.finished_time = time.monotonic()
            if self.stat_loggers:
                # Reported at once, as a step that ran nothing: an idle engine has no next step.
                self._record_stats(0.0, [], [req], 0)

    def set_decode_pace(self, factor: float) -> None:
        """Limit prefill while requests decode: a step may take at most ``factor`` times a
        decode-only step (0: off). The measured costs are kept."""
        DecodePace(factor)  # refuses a factor in (0, 1] with the remedy
        self.pace.factor = factor
        self.config.scheduler.decode_pace_factor = factor

    def has_unfinished_requests(self) -> bool:
        # A batch in flight counts too: its output must be taken even if its requests were aborted.
        in_flight = self._batch_queue is not None and bool(self._batch_queue.pending)
        return self.scheduler.has_unfinished() or bool(self._compiling) or in_flight

    def warmup(self) -> None:
        """Run one tiny greedy request (a 4-token prefill, then decodes) so one-time costs are
        paid at load rather than by the first user request and its timings: on the CPU platform
        the first prefill ran ~2x its steady time (kernel libraries, thread pool, first-call
        allocations) and the first decode ~9x (recording the batch-1 decode step), so a short
        answer's decode rate read ~40 tokens/s where the steady rate is ~90 (SmolLM2). Greedy, so
        no random numbers are drawn; its blocks are freed, and the statistics start from zero.
        Skipped where the context or the KV cache cannot hold it."""
        # Two decode steps after the prefill's token: one records the batch-1 step, one replays.
        n_prompt, n_new = 4, 3
        if getattr(self.model, "pooling_only", False):
            return  # a classifier generates nothing
        if self.config.model.max_model_len < n_prompt + n_new or (
            self.kv.blocks_for(n_prompt + n_new - 1) > self.kv.num_blocks
        ):
            return
        token = min(self.eos_token_ids, default=0)
        params = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
        rid = self.add_request({"prompt_token_ids": [token] * n_prompt}, params, WARMUP_REQUEST_ID)
        loggers, self.stat_loggers = self.stat_loggers, []  # no user request: nothing to report
        try:
            while self.has_unfinished_requests():
                self.step()
        finally:
            self.abort_request(rid)  # also forgets it (a finished one is already forgotten)
            self.stats = EngineStats()
            self.pace.forget()  # its first steps ran several times their steady time
            if self.speculator is not None:
                self.speculator.reset_stats()
            self.stat_loggers = loggers
            self.kv.reset_prefix_cache()  # its blocks hold nothing a user asked for

    def shutdown(self) -> None:
        """Stop the executor's other processes (if any); the engine is unusable afterwards."""
        self.executor.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's; e.g. after changing the weights in place). False,
        and nothing forgotten, while requests are running."""
        return self.kv.reset_prefix_cache()

    # --------------------------------------------------------------------------- steps
    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of the requests that progressed or finished."""
        failed = self._admit_compiled(wait=not self.scheduler.has_unfinished()) if self._compiling else []  # fmt: skip
        # Pipeline stages each hold a batch (see llmhal.engine.batch_queue); not while speculating:
        # a request's drafts come from its previous step's output. Batches still in flight are
        # collected that way even if max_concurrent_batches has just been set to 1.
        queued = self._batch_queue is not None and bool(self._batch_queue.pending)
        if (self.executor.max_concurrent_batches > 1 or queued) and self.speculator is None:
            return failed + self._step_pipelined()
        batch, prefix_stats = self._schedule()
        if not batch:
            self._check_progress()
            return failed
        t0 = time.perf_counter()
        with self.platform.inference_mode():
            results = self.executor.execute_model(batch)
        return self._process(batch, results, t0, prefix_stats, failed)

    def _schedule(self, busy: frozenset[str] = frozenset(), max_reqs: int | None = None) -> tuple[ScheduledBatch, PrefixCacheStats | None]:  # fmt: skip
        """The next batch, and the prefix-cache statistics its scheduling took."""
        batch = self.scheduler.schedule(busy, max_reqs)
        # Taken every step, so lookups made while no stat logger listens are never reported late.
        prefix_stats = self.kv.take_stats()
        if prefix_stats is not None:
            self.stats.cached_prompt_tokens += prefix_stats.hits
        return batch, prefix_stats

    def _check_progress(self) -> None:
        if self.scheduler.has_unfinished():
            raise RuntimeError(
                "the scheduler made no progress with requests waiting (KV cache too small?)"
            )

    def _step_pipelined(self) -> list[RequestOutput]:
        """vLLM's step with a batch queue: submit a batch while the queue has room (returning at
        once if it still has, to schedule another behind it), else take the oldest's output."""
        from llmhal.engine.batch_queue import BatchQueue, drop_finished

        if self._batch_queue is None:
            self._batch_queue = BatchQueue()
        queue, size = self._batch_queue, self.executor.max_concurrent_batches
        if len(queue.pending) < size:
            batch, prefix_stats = self._schedule(frozenset(queue.busy), queue.share(self.scheduler, size))  # fmt: skip
            if batch:
                with self.platform.inference_mode():
                    queue.push(batch, self.executor.submit_model(batch), prefix_stats)
                if len(queue.pending) < size:
                    return []
        if not queue.pending:
            self._check_progress()
            return []
        flight, t0 = queue.pop()
        with self.platform.inference_mode():
            batch, results = drop_finished(flight.batch, flight.future.result())
        outputs = self._process(batch, results, t0, flight.prefix_stats, []) if batch else []
        queue.done()
        return outputs

    def _process(self, batch: ScheduledBatch, results: Any, t0: float, prefix_stats: PrefixCacheStats | None, failed: list[Any]) -> list[RequestOutput]:  # fmt: skip
        """Hand a step's results (what the executor's execute_model returns) to its requests:
        sample, append, stop, account; ``t0`` is when the step's cost started."""
        logits, sample_reqs, prompt_lps = results
        # Speculative drafts being verified this step (the scheduler trimmed them to what runs).
        verifying = any(r.spec_token_ids for r, _ in batch.items)
        with self.platform.inference_mode():
            if verifying:
                verified = self.speculator.verify(logits, sample_reqs, self.sampler, self._apply_grammars)  # type: ignore[union-attr]  # fmt: skip
                result = None
            else:
                self._apply_grammars(logits, sample_reqs)
                result = self.sampler(logits, sample_reqs) if sample_reqs else None
        if self.speculator is not None and self.speculator.wants_hidden:
            # The target's hidden states of the tokens now committed go to the proposer (EAGLE).
            done = {r.request_id: v.num_accepted for r, v in zip(sample_reqs, verified, strict=True)} if verifying else {}  # fmt: skip
            self.speculator.keep_hidden(batch.items, done)
        for req, entries in prompt_lps:
            for entry in entries:
                self._name_tokens(entry)
            req.prompt_logprobs.extend(entries)  # type: ignore[union-attr]
        prefill = sum(
            n
            for r, n in batch.items
            if n - len(r.spec_token_ids) > 1 or r.num_computed_tokens < len(r.prompt_token_ids)
        )
        for req, n in batch.items:
            # Of a verified chunk, only the last token is known computed; accepted drafts follow.
            req.num_computed_tokens += n - len(req.spec_token_ids)
            self.kv.cache_blocks(req)
        outputs: list[Any] = failed
        pooled = []  # a pooling request ends once its prompt is computed
        for req, _ in batch.items:
            if req.pooling is not None and req.num_computed_tokens >= len(req.prompt_token_ids):
                outputs.append(self._finish_pooling(req))
                pooled.append(req)
        # Each sampled request's previous token time, for the stat loggers' latencies.
        before = [r.metrics.last_token_time for r in sample_reqs] if self.stat_loggers else []
        if result is not None:
            for i, req in enumerate(sample_reqs):
                if i in result.dead:
                    self._end_without_token(req)
                else:
                    self._append_token(req, result.token_ids[i], result.logprobs[i])
                outputs.append(req.to_output(self._hold_back(req)))
        elif verifying:
            decoded = 0
            for req, v in zip(sample_reqs, verified, strict=True):
                decoded += self._append_verified(req, v)
                outputs.append(req.to_output(self._hold_back(req)))
        if self.speculator is not None and sample_reqs:
            live = [r for r in sample_reqs if not r.status.finished]
            self.speculator.propose(live, len(self.scheduler.running))
        # Decode speed counts tokens generated: a verified chunk computes drafts that are dropped.
        dt = self._account(t0, prefill, decoded if verifying else batch.num_tokens, len(batch.preempted))  # fmt: skip
        self.pace.observe(prefill, batch.num_tokens - prefill, dt)
        if self.stat_loggers:
            sampled = list(zip(sample_reqs, before, strict=True))
            ended = [r for r in sample_reqs if r.status.finished]
            generated = decoded if verifying else None
            self._record_stats(dt, sampled, ended, len(batch.preempted), prefix_stats, generated, pooled)  # fmt: skip
        return outputs

    def _apply_grammars(self, logits: torch.Tensor, rows: Sequence[Any]) -> None:
        """Mask each row whose request has a structured-output grammar (once its reasoning, if
        gated, has ended); before the sampler, so logprobs are constrained too."""
        if self._structured is not None:
            gated = [r.grammar if r.reasoning_ended is not False else None for r in rows]
            self._structured.apply(logits, gated)

    def _append_verified(self, req: Request, verified: Any) -> int:
        """Emit a verified run of tokens (a Speculator.verify result) one by one, as decoding
        would, so stop tokens, stop strings and max_tokens inside the run end it there; the KV of
        the accepted drafts counts as computed. Returns the tokens emitted."""
        drafts = req.spec_token_ids
        req.spec_token_ids = []
        emitted = 0
        for token, lps in zip(verified.tokens, verified.logprobs, strict=True):
            self._append_token(req, token, lps)
            emitted += 1
            if req.status.finished:
                return emitted
        if verified.dead:
            self._end_without_token(req)
            return emitted
        # Every emitted token but the last was a draft the target agreed with: its KV (written
        # by this step) is the request's own; the rest of the chunk's KV is overwritten later.
        req.num_computed_tokens += min(emitted - 1, len(drafts))
        self.kv.cache_blocks(req)
        return emitted

    def _record_stats(
        self,
        dt: float,
        sampled: list[tuple[Request, float | None]],
        ended: list[Request],
        preempted: int,
        prefix_stats: PrefixCacheStats | None = None,
        generated: int | None = None,
        pooled: Sequence[Request] = (),
    ) -> None:
        """Feed the stat loggers one step: ``sampled`` pairs each request that got a token with
        the time of its previous one (None: this was its first); ``ended`` are the requests that
        finished (or were aborted); ``generated`` the tokens emitted (None: one per sampled
        request; speculative decoding emits several); ``pooled`` the pooling requests answered
        (their prompts counted, each a finished request with reason stop, no token)."""
        ended = [*ended, *pooled]
        sched = self.scheduler
        used = 1.0 - self.kv.num_free_blocks / self.kv.num_blocks
        # Only requests that got a token (a row with nothing to sample ends without one).
        sampled = [(r, p) for r, p in sampled if r.metrics.last_token_time not in (None, p)]
        ttfts = tuple(
            r.metrics.first_token_time - r.metrics.arrival_time  # type: ignore[operator]
            for r, prev in sampled
            if prev is None
        )
        itls = tuple(r.metrics.last_token_time - prev for r, prev in sampled if prev is not None)  # type: ignore[operator]  # fmt: skip
        spec_stats = None if self.speculator is None else self.speculator.take_step_stats()
        record_all(
            self.stat_loggers,
            SchedulerStats(
                len(sched.running),
                len(sched.waiting),
                used,
                sched.num_preemptions,
                prefix_stats,
            ),
            IterationStats(
                dt,
                # vLLM's count: a request's whole prompt (cached tokens included) once, when its
                # first token comes; chunks before it and recomputation after preemption add none.
                sum(len(r.prompt_token_ids) for r, prev in sampled if prev is None)
                + sum(len(r.prompt_token_ids) for r in pooled),
                len(sampled) if generated is None else generated,
                tuple(r.request_id for r in ended),
                preempted,
                time_to_first_tokens=ttfts,
                inter_token_latencies=itls,
                finished_requests=tuple(_finished_stats(r) for r in ended),
                spec_decoding_stats=spec_stats,
            ),
        )

    def _account(self, t0: float, prefill: int, total: int, preempted: int) -> float:
        dt = time.perf_counter() - t0
        self.stats.steps += 1
        self.stats.preemptions += preempted
        if prefill:
            self.stats.prefill_tokens += prefill
            self.stats.prefill_seconds += dt
        else:
            self.stats.decode_tokens += total
            self.stats.decode_seconds += dt
        return dt

    def _name_tokens(self, entry: dict[int, Logprob]) -> None:
        """Fill each log-probability's ``decoded_token`` (the sampler has no tokenizer)."""
        for t, lp in entry.items():
            lp.decoded_token = self.token_text(t)

    @staticmethod
    def _hold_back(req: Request) -> int:
        stops = req.params.stop or []
        return max((len(s) for s in stops), default=1) - 1

    def _append_token(self, req: Request, token: int, logprobs: dict[int, Logprob] | None) -> None:
        # A structured output ends when its grammar is complete, ignore_eos or not; the token
        # that completes it is text (a choice's last word) unless it is a stop or EOS token.
        status, is_text = None, False
        if req.reasoning_ended is False:  # still reasoning: the grammar starts after the end
            ids = TokenView(req.prompt_token_ids, req.output_token_ids, [token])
            req.reasoning_ended = self.reasoner.is_reasoning_end_streaming(ids, [token])  # type: ignore[union-attr]
        elif req.grammar is not None:
            if not req.grammar.accept_tokens(req.request_id, [token]):
                # Unreachable while the mask holds (the sampler only picks allowed tokens; a row
                # with none is ended before this); kept so a broken backend cannot emit text
                # outside the grammar.
                logger.warning("request %s: its grammar refused token %d", req.request_id, token)
                self._end_without_token(req)
                return
            if req.grammar.is_terminated():
                status = RequestStatus.FINISHED_STOPPED
                is_text = token not in self.eos_token_ids | set(req.params.stop_token_ids)
        now = time.monotonic()
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        req.output_token_ids.append(token)
        if logprobs is not None and req.logprobs is not None:
            self._name_tokens(logprobs)
            req.logprobs.append(logprobs)
            req.cumulative_logprob += logprobs[token].logprob
        if status is None and (
            token in req.eos_token_ids and len(req.output_token_ids) > req.params.min_tokens - 1
        ):
            status = RequestStatus.FINISHED_STOPPED
        elif status is None and token in req.params.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        # A stop token stays in token_ids but, as in vLLM, its text joins the output only with
        # include_stop_str_in_output (a stop_token_ids token's text, or an EOS kept by
        # skip_special_tokens=False, showed up at the end of the text).
        stopped_by_token = (
            status is not None and not is_text and not req.params.include_stop_str_in_output
        )
        delta = "" if stopped_by_token else req.detokenizer.add([token])
        # Stop strings count only once min_tokens are out, as in vLLM.
        if (
            status is None
            and delta
            and req.params.stop
            and len(req.output_token_ids) > req.params.min_tokens
        ):
            status = self._check_stop_strings(req, delta)
        if status is None and (
            len(req.output_token_ids) >= req.max_tokens
            or req.num_tokens >= self.config.model.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self._finish(req, status)

    def _finish_pooling(self, req: Request) -> Any:
        from llmhal.pooling.requests import pooling_output

        out = pooling_output(req, self.model)
        self._finish(req, RequestStatus.FINISHED_STOPPED)  # its blocks freed (cached ones kept)
        return out

    def _end_without_token(self, req: Request) -> None:
        """End a request whose settings left no token to sample (see SampleResult.dead): its
        output so far is what it gets, as "stop"; the rest of the batch goes on."""
        if req.grammar is None or not req.grammar.is_terminated():
            logger.warning(
                "request %s: no token is allowed by its settings together (structured output, "
                "min_tokens, allowed_token_ids, logit_bias); ending it after %d tokens",
                req.request_id,
                len(req.output_token_ids),
            )
        self._finish(req, RequestStatus.FINISHED_STOPPED)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.stop_reason is None or isinstance(req.stop_reason, int):
            req.detokenizer.flush()
        req.metrics.finished_time = time.monotonic()
        self.scheduler.finish(req, status)
        if self.speculator is not None:
            req.spec_token_ids = []
            self.speculator.finish(req.request_id)
        self._requests.pop(req.request_id, None)

    @staticmethod
    def _check_stop_strings(req: Request, delta: str) -> RequestStatus | None:
        text = req.detokenizer.text
        longest = max(len(s) for s in req.params.stop)  # type: ignore[union-attr]
        start = max(0, len(text) - len(delta) - longest + 1)
        hits = [(text.find(s, start), s) for s in req.params.stop]  # type: ignore[union-attr]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        idx, stop = min(hits)
        end = idx + len(stop) if req.params.include_stop_str_in_output else idx
        req.detokenizer.text = text[:end]
        req.stop_reason = stop
        return RequestStatus.FINISHED_STOPPED


def _finished_stats(req: Request) -> FinishedRequestStats:
    m = req.metrics
    end = m.finished_time if m.finished_time is not None else time.monotonic()
    return FinishedRequestStats(
        request_id=req.request_id,
        finish_reason=req.status.value,
        num_prompt_tokens=len(req.prompt_token_ids),
        num_generation_tokens=len(req.output_token_ids),
        e2e_latency=end - m.arrival_time,
        time_to_first_token=None
        if m.first_token_time is None
        else m.first_token_time - m.arrival_time,
    )
