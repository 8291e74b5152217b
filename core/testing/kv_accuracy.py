"""How far a quantized KV cache moves a model's output from the unquantized cache's.

:func:`compare_kv_formats` runs the same model through ``LLM`` once per ``kv_cache_dtype`` and
measures, against ``"auto"`` (the model dtype):

* **logit closeness, teacher-forced**: the unquantized run's greedy sequences (prompt and output)
  are scored again as prompts under each format; the log-probability each format gives each actual
  next token is compared with the unquantized one (max and mean absolute difference). Feeding the
  same tokens keeps one early divergence from making every later position incomparable.
* **greedy agreement**: the steps each prompt's greedy tokens equal the unquantized ones, and, where
  they part, the unquantized run's log-probability gap between its own choice and the quantized
  run's (a small gap means the two were nearly tied, so the cache's rounding decided it).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class KVAccuracy:
    """One format's distance from the unquantized cache (see the module docstring)."""

    cache_dtype: str
    kv_cache_bytes_per_token: int
    agreement: tuple[int, ...]  # greedy steps equal to the unquantized run's, per prompt
    # Per prompt that parted: unquantized logprob of its token minus that of the quantized run's
    # token, at the first differing step (inf: the quantized token was outside the top logprobs).
    gaps_at_divergence: tuple[float, ...]
    max_logprob_diff: float
    mean_logprob_diff: float

    def summary(self) -> str:
        gaps = ", ".join(f"{g:.3f}" for g in self.gaps_at_divergence) or "-"
        return (
            f"{self.cache_dtype}: {self.kv_cache_bytes_per_token} B/token, greedy agreement "
            f"{list(self.agreement)} steps (top-1 gap where they part: {gaps}), teacher-forced "
            f"|dlogprob| max {self.max_logprob_diff:.4f} mean {self.mean_logprob_diff:.4f}"
        )


def compare_kv_formats(
    model: str,
    prompts: Sequence[Sequence[int] | str],
    formats: Sequence[str],
    steps: int,
    **llm_kwargs: Any,
) -> dict[str, KVAccuracy]:
    """Each of ``formats`` (and ``"auto"``, the baseline) measured on ``model`` over ``steps``
    greedy steps of every prompt (token ids or text); ``llm_kwargs`` go to every ``LLM``."""
    from llmhal import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=5)
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]
    base_outs: list[Any] = []
    base_scores: list[Any] = []
    sequences: list[list[int]] = []
    result: dict[str, KVAccuracy] = {}
    for fmt in ["auto", *[f for f in formats if f != "auto"]]:
        llm = LLM(model, kv_cache_dtype=fmt, **llm_kwargs)
        outs = llm.generate(inputs, greedy, use_tqdm=False)
        if fmt == "auto":
            base_outs = outs
            sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
        scores = llm.generate([{"prompt_token_ids": s} for s in sequences], scored, use_tqdm=False)
        if fmt == "auto":
            base_scores = scores
        result[fmt] = _measure(
            fmt, llm.load_report.kv_cache_bytes_per_token, base_outs, outs, base_scores, scores,
            sequences,
        )  # fmt: skip
        del llm
        gc.collect()  # one model and cache at a time
    return result


def _measure(
    fmt: str,
    bytes_per_token: int,
    base_outs: list[Any],
    outs: list[Any],
    base_scores: list[Any],
    scores: list[Any],
    sequences: list[list[int]],
) -> KVAccuracy:
    agreement, gaps = [], []
    for a, b in zip(base_outs, outs, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        n = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
        agreement.append(n)
        if n < len(ta):
            top = a.outputs[0].logprobs[n]
            other = top[tb[n]].logprob if tb[n] in top else float("-inf")
            gaps.append(top[ta[n]].logprob - other)
    diffs = []
    for a, b, seq in zip(base_scores, scores, sequences, strict=True):
        for i in range(1, len(seq)):
            want, got = a.prompt_logprobs[i][seq[i]].logprob, b.prompt_logprobs[i][seq[i]].logprob
            diffs.append(abs(want - got))
    return KVAccuracy(
        fmt, bytes_per_token, tuple(agreement), tuple(gaps), max(diffs), sum(diffs) / len(diffs)
    )


def save_tiny_mla(folder: str | Path) -> tuple[str, Any]:
    """A tiny random DeepSeek-V2 checkpoint (3 layers, MLA with a latent of 32 + 16 values, 4
    routed experts) and tokenizer saved in ``folder``: (the folder, its HF config)."""
    from llmhal.testing.model_parity import save_tiny_model, tiny_config
    from llmhal.testing.tiny_models import make_tokenizer

    cfg = tiny_config(
        "DeepseekV2ForCausalLM", vocab_size=384, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None,
        topk_method="greedy", initializer_range=0.1,
    )  # fmt: skip
    save_tiny_model(cfg, folder)
    make_tokenizer(cfg.vocab_size).save_pretrained(str(folder))
    return str(folder), cfg
