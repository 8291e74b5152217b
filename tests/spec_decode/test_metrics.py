"""Speculative decoding's numbers reach the stat loggers and /metrics under vLLM's names."""

from __future__ import annotations

import re

from llmhal import SamplingParams
from llmhal.entrypoints.metrics import PrometheusStatLogger


def _value(text: str, name: str, extra: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{{[^}}]*{extra}[^}}]*}} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_counters_match_the_engines_totals(new_llm, base_llm):
    llm = new_llm({"method": "test_random", "num_speculative_tokens": 3})
    # Random drafts over a 4-token vocabulary of allowed ids: some are accepted.
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, allowed_token_ids=[5, 6, 7, 8])  # fmt: skip
    logger = PrometheusStatLogger(llm.engine.config, model_name="tiny")
    llm.engine.stat_loggers.append(logger)
    llm.engine.speculator.proposer.vocab = 9  # drafts among 0..8: many are allowed ones
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, params)
    plain = base_llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    text = logger.render()
    stats = llm.engine.speculator.stats
    assert stats.num_accepted_tokens > 0
    assert _value(text, "vllm:spec_decode_num_drafts_total") == stats.num_drafts
    assert _value(text, "vllm:spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    assert _value(text, "vllm:spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens
    for j in range(3):
        got = _value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", f'position="{j}"')
        assert got == stats.num_accepted_tokens_per_pos[j]
    assert _value(text, "vllm:generation_tokens_total") == 90  # every token, several a step


def test_no_spec_counters_without_a_speculative_config(base_llm):
    text = PrometheusStatLogger(base_llm.engine.config).render()
    assert "spec_decode" not in text
