"""A tiny model and engines over it, with and without speculative decoding (built once)."""

from __future__ import annotations

import random

import pytest

from llmhal.spec_decode import Proposer, register_proposer


class RandomProposer(Proposer):
    """Drafts random tokens (seeded): nearly every draft is rejected, so every verified step
    writes KV for tokens that must never be read."""

    def __init__(self, config, engine_config) -> None:
        super().__init__(config, engine_config)
        self.rng = random.Random(0)
        self.vocab = engine_config.model.hf_config.vocab_size

    def propose(self, requests):
        return [[self.rng.randrange(self.vocab) for _ in range(r.max_draft)] for r in requests]


class ReplayProposer(Proposer):
    """Drafts the continuation the test put in ``answers`` (request's prompt tuple -> tokens),
    with every ``wrong_every``-th draft token replaced: drafts that are right for a while."""

    answers: dict[tuple[int, ...], list[int]] = {}
    wrong_every = 5

    def propose(self, requests):
        out = []
        for r in requests:
            full = self.answers.get(tuple(r.prompt_token_ids), [])
            done = len(r.output_token_ids)
            draft = list(full[done : done + r.max_draft])
            for j in range(len(draft)):
                if (done + j) % self.wrong_every == self.wrong_every - 1:
                    draft[j] = (draft[j] + 1) % 384
            out.append(draft)
        return out


class FixedProposer(Proposer):
    """Drafts ``tokens`` (set by the test) for every request."""

    tokens: list[int] = []

    def propose(self, requests):
        return [self.tokens[: r.max_draft] for r in requests]


register_proposer("test_fixed", FixedProposer)
register_proposer("test_random", RandomProposer)
register_proposer("test_replay", ReplayProposer)


@pytest.fixture(scope="session")
def tiny_folder(tiny_models):
    return tiny_models("llama")[0]


def make_llm(folder, spec=None, **kw):
    from llmhal import LLM

    kw.setdefault("max_model_len", 256)
    return LLM(folder, dtype="float32", speculative_config=spec, **kw)


@pytest.fixture(scope="session")
def base_llm(tiny_folder):
    return make_llm(tiny_folder)


@pytest.fixture(scope="session")
def ngram_llm(tiny_folder):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}  # fmt: skip
    return make_llm(tiny_folder, spec)


@pytest.fixture(scope="session")
def random_llm(tiny_folder):
    return make_llm(tiny_folder, {"method": "test_random", "num_speculative_tokens": 4})


@pytest.fixture(scope="session")
def replay_llm(tiny_folder):
    return make_llm(tiny_folder, {"method": "test_replay", "num_speculative_tokens": 4})


@pytest.fixture(scope="session")
def new_llm(tiny_folder):
    """Build another engine over the tiny model: ``new_llm(spec_config, **LLM arguments)``."""
    return lambda spec=None, **kw: make_llm(tiny_folder, spec, **kw)


@pytest.fixture(scope="session")
def replay_proposer():
    return ReplayProposer


@pytest.fixture(scope="session")
def fixed_proposer():
    return FixedProposer
