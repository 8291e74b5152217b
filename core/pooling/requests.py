"""The engine's side of a pooling request: validated before it is queued, answered when its
prompt is computed (see LLMEngine.prepare_request and LLMEngine.step)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmhal.pooling.outputs import PoolingOutput, PoolingRequestOutput
from llmhal.pooling.params import PoolerConfig, PoolingParams, ResolvedPooling


def check_pooling_request(engine: Any, token_ids: Sequence[int], params: PoolingParams) -> ResolvedPooling:  # fmt: skip
    """The request's pooling settings, or ValueError before any work starts: an empty prompt, one
    past the context (the whole context is usable: nothing is generated), ids outside the
    vocabulary, or more KV blocks than the cache has (the prompt's KV is computed, then freed)."""
    cfg = engine.config.model
    hf = cfg.hf_config
    n = len(token_ids)
    if n == 0:
        raise ValueError("The prompt is empty (0 tokens); give at least one token.")
    if n > cfg.max_model_len:
        raise ValueError(
            f"The prompt is {n} tokens long, but the model's context is {cfg.max_model_len} "
            "tokens (max_model_len); shorten it to pool it."
        )
    vocab = getattr(hf, "vocab_size", None)
    if vocab is not None and any(t < 0 or t >= vocab for t in token_ids):
        raise ValueError(f"prompt_token_ids contain ids outside the vocabulary [0, {vocab})")
    kv = engine.kv
    if kv.blocks_for(n) > kv.num_blocks:
        raise ValueError(
            f"This prompt needs {n} tokens of KV cache while it is computed, but the cache holds "
            f"only {kv.capacity_tokens} tokens; raise kv_cache_memory_bytes or shorten it."
        )
    if params.task == "classify" and not getattr(engine.model, "pooling_only", False):
        archs = ", ".join(getattr(hf, "architectures", None) or ["?"])
        raise ValueError(
            f"classify needs a sequence-classification model (a *ForSequenceClassification "
            f"checkpoint with a classifier head); this model is {archs}, which has none. Compare "
            "texts with score or rerank, or pool them as embeddings"
        )
    config = getattr(engine, "pooler_config", None) or PoolerConfig()
    return params.resolve(config, hf, int(hf.hidden_size))


def pooling_output(req: Any, model: Any = None) -> PoolingRequestOutput:
    """A finished pooling request's answer (its prompt fully computed); a classify request's is
    ``model``'s class probabilities."""
    data = req.pooling.result()
    if req.pooling.pooling.task == "classify":
        import torch

        with torch.inference_mode():
            data = model.classify(data).cpu()
    return PoolingRequestOutput(
        request_id=req.request_id,
        outputs=PoolingOutput(data),
        prompt_token_ids=list(req.prompt_token_ids),
        finished=True,
        num_cached_tokens=req.num_cached_tokens or 0,
        prompt=req.prompt,
    )
