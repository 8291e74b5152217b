"""Which backend compiles a request's constraint, and the per-step token masks.

Backends by name, as lazy class paths (vLLM's names): ``xgrammar`` and ``guidance``. ``auto`` (the
default) tries xgrammar, then guidance for what xgrammar cannot compile (e.g. a schema with
``patternProperties``, a Lark grammar) or when xgrammar is not installed; the choice is made per
request, unlike vLLM, whose first request fixes the backend for the engine. vLLM's ``outlines`` and
``lm-format-enforcer`` backends are not implemented in llmhal and are refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from llmhal.structured_output.backend import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    apply_token_bitmask,
    bitmask_words,
)
from llmhal.structured_output.params import StructuredOutputsParams
from llmhal.utils.imports import MissingDependencyError, resolve_obj_by_qualname

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
    if name == "auto" or name in BACKENDS:
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
        self._bitmask = torch.empty(0, bitmask_words(vocab_size), dtype=torch.int32)

    def backend(self, name: str) -> StructuredOutputBackend:
        if name not in self._backends:
            cls = resolve_obj_by_qualname(BACKENDS[name])
            self._backends[name] = cls(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return self._backends[name]

    def compile(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """A new grammar for one request; ValueError (every backend's reason) if none compiles it."""
        kind, spec = params.key()
        compact = params.disable_any_whitespace
        if self.backend_name != "auto":
            return self.backend(self.backend_name).compile_grammar(kind, spec, compact=compact)
        reasons = []
        for name in AUTO_ORDER:
            try:
                return self.backend(name).compile_grammar(kind, spec, compact=compact)
            except (ValueError, MissingDependencyError) as e:
                reasons.append(str(e))
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
        index = torch.tensor(rows)
        sub = logits.index_select(0, index)
        apply_token_bitmask(sub, mask)
        logits.index_copy_(0, index, sub)

    def destroy(self) -> None:
        for b in self._backends.values():
            b.destroy()
        self._backends.clear()
