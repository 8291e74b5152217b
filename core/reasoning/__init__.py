"""Reasoning parsers: the contract in :mod:`llmhal.reasoning.base`, names in
:mod:`llmhal.reasoning.manager`."""
