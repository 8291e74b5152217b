"""draft_model: another model with the same tokenizer drafts; output equals plain decoding."""

from __future__ import annotations

import pytest

from llmhal import SamplingParams
from llmhal.testing.tiny_models import make_tiny_model

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": list(range(30, 50))}]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_a_draft_model_drafts_and_output_stays_the_same(tmp_path, tiny_folder, new_llm, base_llm):
    other = tmp_path / "other"
    make_tiny_model(other, "llama", seed=1)  # same tokenizer and vocabulary, other weights
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = _ids(base_llm.generate(PROMPTS, params))
    # The target drafting for itself: every draft is accepted.
    same = new_llm({"method": "draft_model", "model": tiny_folder, "num_speculative_tokens": 3})
    assert _ids(same.generate(PROMPTS, params)) == plain
    stats = same.engine.speculator.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.mean_acceptance_length > 3.5
    assert same.engine.speculator.proposer.memory_bytes() > 0
    # Another model: drafts mostly rejected, output unchanged.
    diff = new_llm({"method": "draft_model", "model": str(other), "num_speculative_tokens": 3})
    assert _ids(diff.generate(PROMPTS, params)) == plain
    assert diff.engine.speculator.stats.num_drafts > 0


def test_a_draft_model_needs_the_targets_vocabulary(tmp_path, new_llm):
    other = tmp_path / "small_vocab"
    make_tiny_model(other, "llama", vocab_size=320)
    with pytest.raises(ValueError, match="vocabulary of 320 tokens, the target 384"):
        new_llm({"method": "draft_model", "model": str(other), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="needs 'model'"):
        new_llm({"method": "draft_model", "num_speculative_tokens": 2})
