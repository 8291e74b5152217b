"""MTP (vLLM's ``mtp``): DeepSeek-V3's own multi-token-prediction layers draft from the target's
hidden states.

A DeepSeek-V3 checkpoint carries ``num_nextn_predict_layers`` MTP layers after its decoder layers
(``model.layers.<num_hidden_layers + k>``): ``embed_tokens`` (a copy of the target's), ``enorm``
and ``hnorm`` (RMSNorms), ``eh_proj`` (``[hidden, 2 * hidden]``), a whole DeepSeek decoder layer
(MLA attention and MoE, under the layer's own names) and ``shared_head`` (``norm``, ``head``).
At position ``p`` the layer reads the target's last hidden state ``h_p`` and the embedding of the
token at ``p + 1``::

    x = eh_proj([enorm(embed(t[p + 1])), hnorm(h_p)]);  y = decoder_layer(x, position p)
    logits for t[p + 2] = shared_head.head(shared_head.norm(y))

(the embedding at position 0 is zeroed, as vLLM does). The first draft comes from the newest
committed position; each further draft feeds the layer's own output ``y`` back as ``h`` with the
draft token, one position on (vLLM's chaining, with the first MTP layer when there is one).

The MTP layer attends over its own keys and values for every earlier position, so it has a paged
KV cache of its own, run through a :class:`~llmhal.engine.model_runner.ModelRunner` of its own (its
MLA backend chosen like the target's). Positions computed from committed tokens stay; positions a
draft wrote are overwritten when the real ones are computed. Prompt positions the target took from
its prefix cache have no hidden state: the layer sees zeros there (weaker drafts, same output).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from llmhal.spec_decode.proposer import DraftRequest, Proposer


def _mtp_classes() -> tuple[type, type]:
    """The MTP layer and its model, built on DeepSeek's decoder layer (imported on first use)."""
    from llmhal.layers.layernorm import RMSNorm
    from llmhal.layers.linear import ReplicatedLinear
    from llmhal.layers.vocab_embedding import ParallelLMHead, VocabEmbedding
    from llmhal.models.deepseek_v2 import DEEPSEEK_STACKED, DeepseekDecoderLayer, deepseek_rope
    from llmhal.models.moe import _ExpertLoader
    from llmhal.models.utils import load_weights_by_name

    class SharedHead(nn.Module):
        def __init__(self, config: Any, prefix: str) -> None:
            super().__init__()
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=f"{prefix}.head")  # fmt: skip

    class MTPLayer(DeepseekDecoderLayer):
        """A DeepSeek decoder layer plus the MTP inputs and head, under the checkpoint's names."""

        def __init__(self, config: Any, rotary: Any, layer_idx: int, prefix: str) -> None:
            super().__init__(config, rotary, layer_idx, prefix)
            h = config.hidden_size
            self.embed_tokens = VocabEmbedding(config.vocab_size, h, prefix=f"{prefix}.embed_tokens")  # fmt: skip
            self.enorm = RMSNorm(h, eps=config.rms_norm_eps)
            self.hnorm = RMSNorm(h, eps=config.rms_norm_eps)
            self.eh_proj = ReplicatedLinear(2 * h, h, bias=False, prefix=f"{prefix}.eh_proj")
            self.shared_head = SharedHead(config, f"{prefix}.shared_head")

    class DeepseekMTP(nn.Module):
        """The first MTP layer as a model the runner drives: ``forward(ids, positions)`` with the
        previous hidden states set in ``prev_hidden`` first."""

        def __init__(self, config: Any) -> None:
            super().__init__()
            self.config = config
            first = config.num_hidden_layers
            self.rotary_emb = deepseek_rope(config)
            self.model = nn.Module()
            self.model.layers = nn.ModuleDict(
                {str(first): MTPLayer(config, self.rotary_emb, first, f"model.layers.{first}")}
            )
            self.layer: Any = self.model.layers[str(first)]
            self.prev_hidden: torch.Tensor | None = None
            self.output: torch.Tensor | None = None

        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, **_: Any) -> torch.Tensor:  # fmt: skip
            layer = self.layer
            emb = layer.embed_tokens(input_ids)
            emb = torch.where((positions == 0)[:, None], torch.zeros_like(emb), emb)
            assert self.prev_hidden is not None
            x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(self.prev_hidden.to(emb.dtype))], -1))  # fmt: skip
            y, residual = layer(positions, x, None)
            self.output = y + residual
            return self.output

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            head = self.layer.shared_head
            return head.head.logits(head.norm(hidden)).float()

        def load_weights(self, weights: Any, fallback: dict[str, torch.Tensor]) -> set[str]:
            prefix = f"model.layers.{self.config.num_hidden_layers}."
            mine = {}
            for name, t in weights:
                if name.startswith(prefix):
                    mine[name.replace(".mlp.gate.e_score_correction_bias", ".mlp.experts.e_score_correction_bias")] = t  # fmt: skip
            if not mine:
                raise ValueError(
                    "the checkpoint has no multi-token-prediction weights "
                    f"({prefix}*): speculative method 'mtp' needs a DeepSeek-V3 checkpoint that "
                    "ships them (num_nextn_predict_layers >= 1)"
                )
            for short, t in fallback.items():  # the target's embedding / LM head, when not copied
                mine.setdefault(prefix + short, t)
            experts = _ExpertLoader(self)
            loaded = load_weights_by_name(self, experts.split(mine.items()), stacked=DEEPSEEK_STACKED)  # fmt: skip
            return loaded | experts.finish()

    return MTPLayer, DeepseekMTP


@dataclass
class _State:
    """One request's MTP cache: its blocks and how many committed positions they hold."""

    blocks: list[int] = field(default_factory=list)
    done: int = 0


class MTPProposer(Proposer):
    config_keys: ClassVar[frozenset[str]] = frozenset({"draft_kv_cache_memory_bytes"})
    uses_target_hidden_states: ClassVar[bool] = True

    def __init__(self, config: Any, engine_config: Any) -> None:
        super().__init__(config, engine_config)
        hf = engine_config.model.hf_config
        n = getattr(hf, "num_nextn_predict_layers", 0) or 0
        if n < 1 or not hasattr(hf, "kv_lora_rank"):
            raise ValueError(
                f"speculative method 'mtp' needs a model with multi-token-prediction layers "
                f"(DeepSeek-V3's num_nextn_predict_layers >= 1); {type(hf).__name__} has "
                f"num_nextn_predict_layers={n}. Use another method (e.g. 'ngram')"
            )
        if config.model is not None:
            raise ValueError(
                "speculative_config method 'mtp' reads its layers from the target's checkpoint; "
                "leave 'model' out"
            )
        self.model: Any = None
        self.runner: Any = None
        self.states: dict[str, _State] = {}
        self.free: list[int] = []

    def load_model(self, target_model: Any) -> None:
        from llmhal.config import set_current_config
        from llmhal.engine.builder import _check_all_loaded, process_weights_after_loading
        from llmhal.engine.model_runner import ModelRunner
        from llmhal.model_loader.checkpoint import open_checkpoint
        from llmhal.model_loader.source import resolve_source

        cfg = self.engine_config
        _, model_cls = _mtp_classes()
        device = next(target_model.parameters()).device
        with set_current_config(cfg), torch.device(device):
            model = model_cls(cfg.model.hf_config)
        fallback = {
            "embed_tokens.weight": target_model.model.embed_tokens.weight,
            "shared_head.head.weight": target_model.lm_head.weight,
        }
        ckpt = open_checkpoint(resolve_source(cfg.model.model))
        with set_current_config(cfg), torch.no_grad():
            _check_all_loaded(model, model.load_weights(ckpt.weights(), fallback))
            process_weights_after_loading(model)
        self.model = model.eval()
        self.runner = ModelRunner(cfg, self.model, device)
        self.runner.decode_graphs = None  # the previous hidden states are not graph inputs
        per_block = self.runner.kv_cache_bytes_per_block()
        budget = int(self.config.extra.get("draft_kv_cache_memory_bytes", 64 << 20))
        need = cfg.scheduler.max_num_seqs * math.ceil(cfg.model.max_model_len / cfg.cache.block_size)  # fmt: skip
        blocks = max(1, min(need + 1, budget // per_block))
        self.kv_bytes = self.runner.allocate_kv_cache(blocks)
        self.free = list(range(blocks))

    def memory_bytes(self) -> int:
        if self.model is None:
            return 0
        return self.kv_bytes + sum(p.numel() * p.element_size() for p in self.model.parameters())

    def finish(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.free.extend(state.blocks)

    def _blocks_for(self, state: _State, tokens: int) -> bool:
        need = math.ceil(tokens / self.runner.block_size) - len(state.blocks)
        if need > len(self.free):
            return False
        for _ in range(max(0, need)):
            state.blocks.append(self.free.pop())
        return True

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        # Step 1: every committed position not yet in the MTP cache, up to the newest token's
        # predecessor; its last row gives each request's first draft.
        work = []  # (index, state, first position, hidden rows, token ids)
        for i, r in enumerate(requests):
            if not r.hidden_reaches_newest:
                continue
            state = self.states.setdefault(r.request_id, _State())
            state.done = min(state.done, r.hidden_start)  # recomputed positions start over
            rows = r.hidden_states
            if r.hidden_start > state.done:  # positions the target took from its prefix cache
                gap = rows.new_zeros(r.hidden_start - state.done, rows.shape[-1])
                rows = torch.cat([gap, rows])
            if not self._blocks_for(state, r.num_tokens - 1 + r.max_draft):
                continue
            ids = list(r.prompt_token_ids) + list(r.output_token_ids)
            work.append((i, state, state.done, rows, ids[state.done + 1 : r.num_tokens]))
        out: list[list[int]] = [[] for _ in requests]
        if not work:
            return out
        work.sort(key=lambda w: len(w[4]) != 1)  # the runner wants one-token requests first
        tokens, hidden = self._run([(s, p, ids, rows) for _, s, p, rows, ids in work])
        for _, state, first, _, ids in work:
            state.done = first + len(ids)  # committed positions up to num_tokens - 2 are cached
        live = []
        for j, (i, state, _, _, _) in enumerate(work):
            out[i].append(tokens[j])
            live.append((i, state, hidden[j : j + 1]))
        # Further drafts: one position on, from the layer's own output and the draft token.
        for depth in range(1, max(r.max_draft for r in requests)):
            live = [w for w in live if len(out[w[0]]) < requests[w[0]].max_draft]
            if not live:
                break
            steps = [(s, requests[i].num_tokens - 2 + depth, [out[i][-1]], h) for i, s, h in live]
            tokens, hidden = self._run(steps)
            for j, (i, _, _) in enumerate(live):
                out[i].append(tokens[j])
            live = [(i, s, hidden[j : j + 1]) for j, (i, s, _) in enumerate(live)]
        return out

    def _run(self, steps: list[tuple[_State, int, list[int], torch.Tensor]]) -> tuple[list[int], torch.Tensor]:  # fmt: skip
        """One forward of the MTP layer: per request (state, first position, token ids, previous
        hidden rows); the greedy token and the output hidden state of each request's last row."""
        from llmhal.engine.model_runner import StepInput

        ids, lens, computed, tables, rows = [], [], [], [], []
        for state, first, toks, _ in steps:
            ids.extend(toks)
            lens.append(len(toks))
            computed.append(first)
            tables.append(state.blocks)
            rows.append(len(ids) - 1)
        self.model.prev_hidden = torch.cat([h for *_, h in steps])
        out = self.runner.run(StepInput(ids, lens, computed, tables, rows, [], []))
        hidden = self.model.output[torch.tensor(rows, device=self.model.output.device)]
        return out.logits.argmax(-1).tolist(), hidden
