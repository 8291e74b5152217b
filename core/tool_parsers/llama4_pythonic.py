"""``llama4_pythonic``: Llama 4's pythonic calls, ``[get_weather(city="Paris")]``, optionally
wrapped in ``<|python_start|>`` ... ``<|python_end|>`` (both special tokens)."""

from __future__ import annotations

from llmhal.tool_parsers.pythonic import PythonicToolParser


class Llama4PythonicToolParser(PythonicToolParser):
    markers = ("<|python_start|>", "[")
