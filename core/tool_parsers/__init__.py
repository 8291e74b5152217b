"""Tool-call parsers: the contract in :mod:`llmhal.tool_parsers.base`, names in
:mod:`llmhal.tool_parsers.manager`."""
