"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a choice or a
grammar (the contract in :mod:`llmhal.structured_output.backend`; backends in
:mod:`llmhal.structured_output.manager`)."""

from llmhal.structured_output.params import StructuredOutputOptions, StructuredOutputsParams

__all__ = ["StructuredOutputOptions", "StructuredOutputsParams"]
