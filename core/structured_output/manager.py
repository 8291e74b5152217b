"""Which backend compiles a request's constraint, and the per-step token masks.

Backends by name, as lazy class paths (vLLM's names): ``xgrammar`` and ``guidance``. ``auto`` (the
default) tries xgrammar, then guidance for what xgrammar cannot compile (e.g. a schema with
``patternProperties``, a Lark grammar) or when xgrammar is not installed; the choice is made per
request, unlike vLLM, whose first request fixes the backend for the engine. vLLM's ``outlines`` and
``lm-format-enforcer`` backends are not implemented in llmhal and are refused by name.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from llmhal.structured_output.backend import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    apply_token_bitmask,
    bitmask_words,
)
from llmhal.structured_output.params import StructuredOutputOptions, StructuredOutputsParams
from llmhal.structured_output.schema_checks import unsatisfiable_ref_loop
from llmhal.utils.imports import resolve_obj_by_qualname

BACKENDS = {
    "xgrammar": "llmhal.structured_output.xgrammar_backend:XgrammarBackend",
    "guidance": "llmhal.structured_output.guidance_backend:GuidanceBackend",
}
AUTO_ORDER = ("xgrammar", "guidance")
NOT_IMPLEMENTED = ("outlines", "lm-format-enforcer")


_MODULES = {"xgrammar": ("xgrammar", "xgrammar"), "guidance": ("llguidance", "llguidance")}


def backend_status() -> list[dict[str, Any]]:
    """Each backend name with whether it can run here and why not (for ``llmhal doctor``); looks
    for the libraries without importing them."""
    from llmhal.utils.imports import is_available, not_installed

    rows = []
    for name in BACKENDS:
        module, package = _MODULES[name]
        ok = is_available(module)
        rows.append({"name": name, "available": ok, "reasons": [] if ok else [not_installed(module, package)]})  # fmt: skip
    for name in NOT_IMPLEMENTED:
        rows.append({"name": name, "available": False, "reasons": ["not implemented in llmhal"]})
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
    if name in NOT_IMPLEMENTED:
        raise ValueError(
            f"the {name!r} structured-output backend is not implemented in llmhal; use "
            f"'auto', {', '.join(map(repr, BACKENDS))}"
        )
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


class StructuredOutputManager:
    """One per engine: backends made on first use, a grammar per constrained request."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], backend: str = "auto"
    ) -> None:
        self.backend_name = check_backend_name(backend)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._failed: dict[str, str] = {}  # backends that could not start, and why (not retried)
        self._lock = threading.Lock()  # requests are compiled on the callers' threads
        self._bitmask = torch.empty(0, bitmask_words(vocab_size), dtype=torch.int32)

    def backend(self, name: str) -> StructuredOutputBackend:
        """The engine's instance of backend ``name``; ValueError if it cannot start here."""
        with self._lock:
            if name not in self._backends and name not in self._failed:
                try:
                    cls = resolve_obj_by_qualname(BACKENDS[name])
                    self._backends[name] = cls(self.tokenizer, self.vocab_size, self.stop_token_ids)
                except Exception as e:  # a missing library, or one that rejects this tokenizer
                    self._failed[name] = f"the {name} backend cannot start: {e}"
            if name in self._failed:
                raise ValueError(self._failed[name])
            return self._backends[name]

    def compile(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """A new grammar for one request; ValueError (every backend's reason) if none compiles it."""
        kind, spec = params.key()
        if kind is StructuredOutputOptions.JSON:
            check_json_schema(spec)
        compact = params.disable_any_whitespace
        names = AUTO_ORDER if self.backend_name == "auto" else (self.backend_name,)
        reasons = []
        for name in names:
            try:
                return self.backend(name).compile_grammar(kind, spec, compact=compact)
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
        index = torch.tensor(rows, device=logits.device)
        sub = logits.index_select(0, index)
        apply_token_bitmask(sub, mask.to(logits.device))
        logits.index_copy_(0, index, sub)

    def destroy(self) -> None:
        for b in self._backends.values():
            b.destroy()
        self._backends.clear()
