"""Model registry: HF architecture name -> model class, lazily imported.

``ModelRegistry.register_model(arch, "pkg.mod:Class")`` serves out-of-tree models (a lazy string is
recommended: importing a model module may be expensive). Registering an existing architecture
replaces it with a warning.
"""

from __future__ import annotations

import threading
from typing import Any

from llmhal.logger import init_logger

logger = init_logger(__name__)

_BUILTIN: dict[str, str] = {
    "LlamaForCausalLM": "llmhal.models.llama:LlamaForCausalLM",
    "LlamaForSequenceClassification": "llmhal.models.seq_cls:LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification": "llmhal.models.seq_cls:Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification": "llmhal.models.seq_cls:Qwen3ForSequenceClassification",
    "MistralForCausalLM": "llmhal.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "llmhal.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "llmhal.models.qwen3:Qwen3ForCausalLM",
    "MixtralForCausalLM": "llmhal.models.mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "llmhal.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "llmhal.models.qwen3_moe:Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM": "llmhal.models.deepseek_v2:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "llmhal.models.deepseek_v2:DeepseekV3ForCausalLM",
    "OlmoeForCausalLM": "llmhal.models.olmoe:OlmoeForCausalLM",
    "MambaForCausalLM": "llmhal.models.mamba:MambaForCausalLM",
    "FalconMambaForCausalLM": "llmhal.models.mamba:FalconMambaForCausalLM",
    "Mamba2ForCausalLM": "llmhal.models.mamba2:Mamba2ForCausalLM",
    "Lfm2ForCausalLM": "llmhal.models.lfm2:Lfm2ForCausalLM",
    "Lfm2MoeForCausalLM": "llmhal.models.lfm2:Lfm2MoeForCausalLM",
    "MiniMaxForCausalLM": "llmhal.models.minimax:MiniMaxForCausalLM",
    "BambaForCausalLM": "llmhal.models.bamba:BambaForCausalLM",
}


class _ModelRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, str | type] = dict(_BUILTIN)

    def register_model(self, arch: str, model_cls: str | type) -> None:
        if not isinstance(arch, str):
            raise TypeError(f"architecture must be a str, got {type(arch).__name__}")
        if isinstance(model_cls, str):
            if model_cls.count(":") != 1:
                raise ValueError(
                    f"Expected a string in the format <module>:<class>, got {model_cls!r}"
                )
        elif not isinstance(model_cls, type):
            raise TypeError(
                f"model_cls must be a class or a '<module>:<class>' string, got {model_cls!r}"
            )
        with self._lock:
            if arch in self._models:
                logger.warning(
                    "Model architecture %s is already registered and is replaced by %s",
                    arch,
                    model_cls,
                )
            self._models[arch] = model_cls

    def get_supported_archs(self) -> list[str]:
        with self._lock:
            return list(self._models)

    def is_registered(self, arch: str) -> bool:
        with self._lock:
            return arch in self._models

    def load_model_cls(self, arch: str) -> type:
        with self._lock:
            entry = self._models.get(arch)
        if entry is None:
            raise KeyError(arch)
        if isinstance(entry, type):
            return entry
        from llmhal.utils.imports import resolve_obj_by_qualname

        return resolve_obj_by_qualname(entry)

    def resolve_model_cls(self, architectures: list[str] | str) -> tuple[type, str]:
        """The class of the first registered architecture in ``architectures``."""
        archs = [architectures] if isinstance(architectures, str) else list(architectures or [])
        if not archs:
            raise ValueError("No model architectures are specified in the model's config.json")
        for arch in archs:
            if self.is_registered(arch):
                return self.load_model_cls(arch), arch
        raise ValueError(
            f"Model architectures {archs} are not supported for now. Supported architectures: "
            f"{', '.join(sorted(self.get_supported_archs()))}. Out-of-tree models can be added with "
            f"ModelRegistry.register_model(arch, 'pkg.module:Class') from a general plugin."
        )

    def _restore_builtins_for_tests(self) -> None:
        with self._lock:
            self._models = dict(_BUILTIN)


ModelRegistry = _ModelRegistry()


def get_registry() -> Any:
    return ModelRegistry
