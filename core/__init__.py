"""llmhal: a hardware-platform abstraction layer for LLM inference.

``import llmhal`` is cheap: it imports neither torch nor any plugin. The public names below are
resolved on first access (PEP 562), so ``from llmhal import LLM`` pays for the engine only then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmhal.utils.openmp import apply_default_wait_policy

# Before torch loads its OpenMP runtime (which reads the policy once): see llmhal.utils.openmp.
apply_default_wait_policy()

__version__ = "0.1.0"

# public name -> "module:attribute"; resolved lazily.
_LAZY = {
    "LLM": "llmhal.engine.llm:LLM",
    "SamplingParams": "llmhal.engine.sampling_params:SamplingParams",
    "RequestOutput": "llmhal.engine.outputs:RequestOutput",
    "CompletionOutput": "llmhal.engine.outputs:CompletionOutput",
    "ModelRegistry": "llmhal.models.registry:ModelRegistry",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "ModelRegistry",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.engine.llm import LLM
    from llmhal.engine.outputs import CompletionOutput, RequestOutput
    from llmhal.engine.sampling_params import SamplingParams
    from llmhal.models.registry import ModelRegistry


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'llmhal' has no attribute {name!r}")
    from llmhal.utils.imports import resolve_obj_by_qualname

    value = resolve_obj_by_qualname(target)
    globals()[name] = value
    return value
