"""Sequence classifiers (transformers' ``*ForSequenceClassification``): a decoder whose last prompt
position's final hidden state goes through a linear ``score`` head (``num_labels`` outputs, no
bias), as transformers' Llama, Qwen2 and Qwen3 classifiers compute it.

These are pooling-only models (``pooling_only``): the engine refuses to generate with them, and
their requests are ``classify`` pooling requests (``LLM.classify``, ``POST /classify``) answered
with the head's softmax. The decoder is the causal LM's own, built with its embedding tied in as
the LM head so no vocabulary-sized head is allocated or expected in the checkpoint.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch

from llmhal.models.llama import LlamaForCausalLM
from llmhal.models.qwen2 import Qwen2ForCausalLM
from llmhal.models.qwen3 import Qwen3ForCausalLM


class _SequenceClassifier:
    """Mixed in before a causal LM class: adds ``score`` and loads it."""

    pooling_only = True

    def __init__(self, hf_config: Any, prefix: str = "") -> None:
        if not getattr(hf_config, "num_labels", None):
            raise ValueError("a sequence-classification checkpoint needs num_labels in its config")
        # A tied head reuses the embedding: a classifier's checkpoint has no lm_head tensor.
        decoder_config = copy.copy(hf_config)
        decoder_config.tie_word_embeddings = True
        super().__init__(decoder_config, prefix)  # type: ignore[call-arg]
        self.config = hf_config
        self.score = torch.nn.Linear(hf_config.hidden_size, hf_config.num_labels, bias=False)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Class probabilities (fp32) of pooled final hidden states ``[..., hidden]``."""
        logits = self.score(pooled.to(self.score.weight.dtype))
        return logits.float().softmax(-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        head: dict[str, torch.Tensor] = {}

        def decoder_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, t in weights:
                if name.startswith("score."):
                    head[name] = t
                else:
                    yield name, t

        loaded = super().load_weights(decoder_weights())  # type: ignore[misc]
        if "score.weight" not in head:
            raise ValueError("the checkpoint has no score.weight (the classifier head)")
        w = head["score.weight"]
        if tuple(w.shape) != tuple(self.score.weight.shape):
            raise ValueError(f"score.weight has shape {tuple(w.shape)}, expected {tuple(self.score.weight.shape)} (num_labels x hidden_size)")  # fmt: skip
        with torch.no_grad():
            self.score.weight.copy_(w.to(self.score.weight.dtype))
        return loaded | {"score.weight"}


class LlamaForSequenceClassification(_SequenceClassifier, LlamaForCausalLM):
    pass


class Qwen2ForSequenceClassification(_SequenceClassifier, Qwen2ForCausalLM):
    pass


class Qwen3ForSequenceClassification(_SequenceClassifier, Qwen3ForCausalLM):
    pass
