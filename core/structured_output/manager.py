"""Which backend compiles a request's constraint, where and when, and the per-step token masks.

Backends by name, as lazy class paths (vLLM's names): ``xgrammar``, ``guidance``, ``outlines`` and
``lm-format-enforcer``. ``auto`` (the default) tries xgrammar, then guidance for what xgrammar
cannot compile or would not enforce (e.g. a schema with ``patternProperties``, a Lark grammar) or
when xgrammar is not installed; the choice is made per request, unlike vLLM, whose first request
fixes the backend for the engine. outlines and lm-format-enforcer are used only when named: they
take JSON schemas, regexes and choices but no grammars, and enforce fewer schema keywords.

Compiling is off the engine's path, as in vLLM: :meth:`StructuredOutputManager.request` hands the
constraint to a small thread pool and returns a :class:`PendingGrammar` at once; the compiled
result is cached by (backend, kind, spec, compactness), so a schema sent again (or by n requests
at once) is compiled once, and a failure is remembered too. The libraries that hold the GIL while
they compile (outlines-core, lm-format-enforcer's interegular) do that part in worker processes
(:mod:`llmhal.structured_output.compile_pool`), so running requests decode at their pace
meanwhile; each request's own grammar is made off the engine's thread too (:class:`PendingGrammar`).
``async_compile=False`` compiles on the caller's thread instead (vLLM turns the pool off for its
``external_launcher`` executor).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from llmhal.structured_output.backend import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    apply_token_bitmask,
    bitmask_words,
)
from llmhal.structured_output.compile_pool import CompileProcesses
from llmhal.structured_output.params import StructuredOutputOptions, StructuredOutputsParams
from llmhal.structured_output.schema_checks import unsatisfiable_ref_loop
from llmhal.utils.imports import resolve_obj_by_qualname

BACKENDS = {
    "xgrammar": "llmhal.structured_output.xgrammar_backend:XgrammarBackend",
    "guidance": "llmhal.structured_output.guidance_backend:GuidanceBackend",
    "outlines": "llmhal.structured_output.outlines_backend:OutlinesBackend",
    "lm-format-enforcer": "llmhal.structured_output.lm_format_enforcer_backend:LMFormatEnforcerBackend",
}
AUTO_ORDER = ("xgrammar", "guidance")

# Each backend's (module to import, package to install).
_MODULES = {
    "xgrammar": ("xgrammar", "xgrammar"),
    "guidance": ("llguidance", "llguidance"),
    "outlines": ("outlines_core", "outlines-core"),
    "lm-format-enforcer": ("lmformatenforcer", "lm-format-enforcer"),
}
# Compiled constraints kept per engine (least recently used dropped first), and compile threads:
# two, so one slow schema does not hold up every other request's, and no more, so compiling
# never takes the cores decoding runs on.
CACHE_SIZE = 256
COMPILE_THREADS = 2


def backend_status() -> list[dict[str, Any]]:
    """Each backend name with whether it can run here and why not (for ``llmhal doctor``); looks
    for the libraries without importing them."""
    from llmhal.utils.imports import is_available, not_installed

    rows = []
    for name in BACKENDS:
        module, package = _MODULES[name]
        ok = is_available(module)
        rows.append({"name": name, "available": ok, "reasons": [] if ok else [not_installed(module, package)]})  # fmt: skip
    return rows


def check_backend_name(name: str) -> str:
    """``name`` if it is a backend llmhal has; for an explicit one, its library must import
    (MissingDependencyError naming the package, before any model loads)."""
    if name == "auto":
        return name
    if name in BACKENDS:
        from llmhal.utils.imports import require

        module, package = _MODULES[name]
        require(module, package=package, purpose=f"the {name} structured-output backend")
        return name
    raise ValueError(
        f"unknown structured-output backend {name!r}; choose 'auto', "
        f"{', '.join(map(repr, BACKENDS))}"
    )


def check_json_schema(spec: str) -> None:
    """ValueError for a schema no output can satisfy (checked for every backend alike)."""
    import json

    try:
        loop = unsatisfiable_ref_loop(json.loads(spec))
    except RecursionError:
        raise ValueError("the structured-output constraint is nested too deeply") from None
    if loop is not None:
        raise ValueError(
            f"the JSON schema can never be satisfied: its $ref loop {loop} never reaches a value "
            "(no finite JSON document matches it); give the loop a way out, e.g. make the "
            "recursive property optional or add an anyOf branch without the reference"
        )


def _lower_priority() -> None:
    """Run a compile thread at the lowest priority (Linux threads have their own nice value):
    on a busy machine decoding keeps its cores. (The libraries compiling on these threads,
    xgrammar and llguidance, give the GIL back while they work.)"""
    import os

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: the default priority
        pass


class PendingGrammar:
    """One request's grammar while its constraint compiles: :meth:`ready` says whether the
    compile is over (never blocks), :meth:`result` waits for it and returns the request's own
    grammar, or raises ValueError saying why the constraint cannot be served."""

    def __init__(self, compiled: Future, manager: StructuredOutputManager) -> None:
        self._manager = manager
        # The request's own grammar is made on a compile thread once the constraint is compiled
        # (cached or not), never on the engine's: making one can cost as much as a compile
        # (lm-format-enforcer's parser over a schema's patterns).
        self._made: Future = Future()
        compiled.add_done_callback(self._compiled)

    def _compiled(self, compiled: Future) -> None:
        pool = self._manager._pool
        if pool is None:  # compiling on the caller's thread: make it there too
            self._make(compiled)
            return
        try:
            pool.submit(self._make, compiled)
        except RuntimeError as e:  # the manager was destroyed
            self._made.set_exception(e)

    def _make(self, compiled: Future) -> None:
        try:
            name, constraint = compiled.result()
            self._made.set_result(self._manager.backend(name).grammar(constraint))
        except BaseException as e:
            self._made.set_exception(e)

    def ready(self) -> bool:
        return self._made.done()

    def result(self, timeout: float | None = None) -> StructuredOutputGrammar:
        return self._made.result(timeout)

    @staticmethod
    def wait_any(pending: Sequence[PendingGrammar], timeout: float) -> None:
        """Return when one of ``pending`` is ready, or after ``timeout`` seconds."""
        import concurrent.futures

        concurrent.futures.wait([p._made for p in pending], timeout, concurrent.futures.FIRST_COMPLETED)  # fmt: skip

    def error(self) -> BaseException | None:
        """Why the compile failed (None while it runs or when it succeeded)."""
        return self._made.exception() if self._made.done() else None


class StructuredOutputManager:
    """One per engine: backends made on first use, compiled constraints cached, a grammar per
    constrained request."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        backend: str = "auto",
        *,
        async_compile: bool = True,
    ) -> None:
        self.backend_name = check_backend_name(backend)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.async_compile = async_compile
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._failed: dict[str, str] = {}  # backends that could not start, and why (not retried)
        self._lock = threading.Lock()  # requests are submitted from the callers' threads
        self._compiled: OrderedDict[tuple[Any, ...], Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        # Worker processes for the libraries that hold the GIL while compiling (outlines-core,
        # lm-format-enforcer's interegular), started on their first compile.
        self.processes = CompileProcesses(COMPILE_THREADS) if async_compile else None
        self._bitmask = torch.empty(0, bitmask_words(vocab_size), dtype=torch.int32)
        self._scratch: dict[Any, Any] = {}  # apply_token_bitmask's buffers
        self.compiles = 0  # constraints compiled (cache misses), for tests and benchmarks

    def backend(self, name: str) -> StructuredOutputBackend:
        """The engine's instance of backend ``name``; ValueError if it cannot start here."""
        with self._lock:
            if name not in self._backends and name not in self._failed:
                try:
                    cls = resolve_obj_by_qualname(BACKENDS[name])
                    made = cls(self.tokenizer, self.vocab_size, self.stop_token_ids)
                    made.processes = self.processes
                    self._backends[name] = made
                except Exception as e:  # a missing library, or one that rejects this tokenizer
                    self._failed[name] = f"the {name} backend cannot start: {e}"
            if name in self._failed:
                raise ValueError(self._failed[name])
            return self._backends[name]

    def request(self, params: StructuredOutputsParams) -> PendingGrammar:
        """Start compiling a request's constraint (or find it compiled, or compiling) and return
        at once. A constraint refused before any compile (an unsatisfiable schema) raises here."""
        kind, spec = params.key()
        if kind is StructuredOutputOptions.JSON:
            check_json_schema(spec)
        key = (self.backend_name, kind, spec, params.disable_any_whitespace)
        with self._lock:
            fut = self._compiled.get(key)
            if fut is None:
                if self.async_compile:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(COMPILE_THREADS, "llmhal-grammar", _lower_priority)  # fmt: skip
                    fut = self._pool.submit(self._compile, kind, spec, params.disable_any_whitespace)  # fmt: skip
                else:
                    fut = Future()
                self._compiled[key] = fut
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
                fresh = not self.async_compile
            else:
                self._compiled.move_to_end(key)
                fresh = False
        if fresh:  # compiled here, outside the lock
            try:
                fut.set_result(self._compile(kind, spec, params.disable_any_whitespace))
            except BaseException as e:
                fut.set_exception(e)
        return PendingGrammar(fut, self)

    def compile(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """A new grammar for one request, waiting for its compile; ValueError (every backend's
        reason) if none compiles it."""
        return self.request(params).result()

    def _compile(self, kind: StructuredOutputOptions, spec: str, compact: bool) -> tuple[str, Any]:
        """(backend name, compiled constraint); ValueError with every backend's reason."""
        names = AUTO_ORDER if self.backend_name == "auto" else (self.backend_name,)
        reasons = []
        self.compiles += 1
        for name in names:
            try:
                return name, self.backend(name).compile(kind, spec, compact=compact)
            except RecursionError:
                raise ValueError("the structured-output constraint is nested too deeply") from None
            except ValueError as e:
                reasons.append(str(e))
            except Exception as e:  # a backend's own failure: under auto, the next one may serve
                if self.backend_name != "auto":
                    raise ValueError(f"the {name} backend failed on this constraint: {e}") from e
                reasons.append(f"the {name} backend failed on this constraint: {e}")
        if len(reasons) == 1:
            raise ValueError(reasons[0])
        raise ValueError("no structured-output backend can serve this request: " + "; ".join(reasons))  # fmt: skip

    def apply(
        self, logits: torch.Tensor, grammars: Sequence[StructuredOutputGrammar | None]
    ) -> None:
        """Mask, in place, the logits rows whose grammar (``grammars[i]`` for row i) is set."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = torch.empty(len(rows), self._bitmask.shape[1], dtype=torch.int32)
        mask = self._bitmask[: len(rows)]
        mask.fill_(-1)
        for j, i in enumerate(rows):
            grammars[i].fill_bitmask(mask, j)  # type: ignore[union-attr]
        if len(rows) == logits.shape[0]:  # every row constrained: no gather and scatter
            apply_token_bitmask(logits, mask.to(logits.device), self._scratch)
            return
        index = torch.tensor(rows, device=logits.device)
        sub = logits.index_select(0, index)
        apply_token_bitmask(sub, mask.to(logits.device), self._scratch)
        logits.index_copy_(0, index, sub)

    def destroy(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self.processes is not None:
            self.processes.close()
        for b in self._backends.values():
            b.destroy()
        self._backends.clear()
        self._compiled.clear()
