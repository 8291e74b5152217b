"""Speculative decoding: proposers draft tokens, the target verifies them in one pass, and the
rejection sampler keeps output lossless. See :mod:`llmhal.spec_decode.proposer` for the contract
and :mod:`llmhal.spec_decode.registry` for adding a method."""

from __future__ import annotations

from llmhal.spec_decode.proposer import DraftRequest, Proposer
from llmhal.spec_decode.registry import available_methods, get_proposer_cls, register_proposer

__all__ = ["DraftRequest", "Proposer", "available_methods", "get_proposer_cls", "register_proposer"]
