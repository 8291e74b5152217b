"""tree_attn: draft-tree verification against the reference, in mixed batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmhal.attention.backend import AttentionRequirements
from llmhal.attention.reference import ReferenceAttentionBackend
from llmhal.attention.tree_attn import TreeAttentionBackend
from llmhal.testing.attention_conformance import (
    AttentionCase,
    check_attention_case,
    conformance_cases,
    random_tree_mask,
    run_attention_case,
)

QUICK = conformance_cases(TreeAttentionBackend)
FULL = conformance_cases(
    TreeAttentionBackend, dtypes=("float32", "bfloat16", "float16"), quick=False
)


@pytest.mark.parametrize("case", QUICK, ids=lambda c: c.id)
def test_tree_conformance(case):
    assert case.tree_size and case.kind == "tree"
    check_attention_case(TreeAttentionBackend, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", FULL, ids=lambda c: c.id)
def test_tree_full_sweep(case):
    check_attention_case(TreeAttentionBackend, case)


def test_tree_cases_really_branch():
    # A chain would be plain causal attention and would not test the tree mask.
    for case in QUICK:
        g = torch.Generator().manual_seed(case.seed)
        mask = random_tree_mask(case.tree_size, g)
        assert mask.diagonal().all()
    branching = [
        not torch.equal(
            random_tree_mask(6, torch.Generator().manual_seed(s)), torch.ones(6, 6).tril().bool()
        )
        for s in range(5)
    ]
    assert all(branching)


def test_tree_mask_is_honoured_not_causal():
    """The same step with the causal rule instead of the tree gives different outputs."""

    class _Causal(ReferenceAttentionBackend):
        name = "causal_only"
        kind = "tree"

        @staticmethod
        def get_builder_cls():
            base = ReferenceAttentionBackend.get_builder_cls()

            class B(base):
                def build(self, common):
                    return super().build(dataclasses.replace(common, tree_mask=None))

            return B

    case = next(c for c in QUICK if c.tree_size == 6)
    assert run_attention_case(TreeAttentionBackend, case).passed
    assert run_attention_case(_Causal, case).failures


def test_tree_groups_split_under_the_score_budget(monkeypatch):
    import llmhal.attention.tree_attn as tree

    monkeypatch.setattr(tree, "SCORE_BUDGET", 1)  # one request per group
    case = AttentionCase(
        64,
        8,
        2,
        "float32",
        kind="tree",
        tree_size=4,
        requests=((9, 1), (30, 4), (17, 4), (0, 6)),
        seed=11,
    )
    check_attention_case(TreeAttentionBackend, case)


def test_tree_validate():
    req = AttentionRequirements(64, 4, 4, torch.bfloat16, kind="tree", sliding_window=8)
    assert TreeAttentionBackend.validate(req) == ["sliding window not supported"]
    mha = AttentionRequirements(64, 4, 4, torch.bfloat16)
    assert TreeAttentionBackend.validate(mha) == ["serves tree layers, not mha"]
