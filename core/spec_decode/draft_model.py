"""Draft-model drafting (vLLM's ``draft_model``): a smaller model with the same tokenizer runs
greedily a few tokens ahead of each request, batched, and the target verifies them.

The draft runs in an engine of its own (its own KV cache and attention backend, chosen like the
target's), with prefix caching on: each call submits every request's committed tokens as a prompt
of ``max_draft`` greedy tokens, and the draft's cache already holds all but the last partial
block of them from the previous call, so a call computes a few tokens per request, not the whole
context. Its requests are dropped as soon as the drafts are read.

The draft model is ``speculative_config["model"]`` (a folder or .gguf file); its vocabulary must be
the target's (checked from its config before any weight loads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from llmhal.spec_decode.proposer import DraftRequest, Proposer


class DraftModelProposer(Proposer):
    config_keys: ClassVar[frozenset[str]] = frozenset({"draft_kv_cache_memory_bytes"})

    @classmethod
    def check_config(cls, config: Any) -> None:
        if not config.model:
            raise ValueError(
                "speculative_config method 'draft_model' needs 'model': the draft model's folder "
                "or .gguf file (same tokenizer as the target)"
            )

    def __init__(self, config: Any, engine_config: Any) -> None:
        super().__init__(config, engine_config)
        from llmhal.model_loader.checkpoint import open_checkpoint
        from llmhal.model_loader.source import resolve_source

        draft_cfg = open_checkpoint(resolve_source(config.model)).hf_config
        target_vocab = getattr(engine_config.model.hf_config, "vocab_size", None)
        draft_vocab = getattr(draft_cfg, "vocab_size", None)
        if target_vocab != draft_vocab:
            raise ValueError(
                f"speculative_config['model']={config.model!r} has a vocabulary of {draft_vocab} "
                f"tokens, the target {target_vocab}: a draft model must share the target's "
                "tokenizer; pick a draft from the same model family"
            )
        self.engine: Any = None
        self._ids = 0

    def load_model(self, target_model: Any) -> None:
        from llmhal.engine.builder import EngineArgs, build_engine

        target = self.engine_config
        args = EngineArgs(
            model=self.config.model,
            max_model_len=min(
                self.config.max_model_len or target.model.max_model_len, target.model.max_model_len
            ),  # fmt: skip
            max_num_seqs=target.scheduler.max_num_seqs,
            kv_cache_memory_bytes=self.config.extra.get("draft_kv_cache_memory_bytes", 64 << 20),
            enforce_eager=bool(self.config.enforce_eager),
            seed=target.model.seed,
            load_progress=False,
        )
        self.engine, self.report = build_engine(args)

    def memory_bytes(self) -> int:
        return 0 if self.engine is None else self.report.weight_bytes + self.report.kv_cache_bytes

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        from llmhal.engine.sampling_params import SamplingParams

        eng = self.engine
        limit = eng.config.model.max_model_len
        rids: list[str | None] = []
        for r in requests:
            k = min(r.max_draft, limit - r.num_tokens)
            if k <= 0:
                rids.append(None)
                continue
            self._ids += 1
            params = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
            ids = list(r.prompt_token_ids) + list(r.output_token_ids)
            rids.append(eng.add_request({"prompt_token_ids": ids}, params, f"draft-{self._ids}"))
        drafts: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    drafts[out.request_id] = out.outputs[0].token_ids
        return [drafts.get(rid, []) if rid is not None else [] for rid in rids]
