"""``granite``: IBM Granite 3.2+ with thinking on, whose answer opens with "Here is my thought
process:" and goes on after "Here is my response:" (plain text, not tokens; "Here's" also
occurs). An answer that does not open with the first phrase is all content. Granite's thinking
system prompt names both phrases, so the id-based answers look only after the assistant turn's
opening."""

from __future__ import annotations

from llmhal.reasoning.markers import MarkerReasoningParser


class GraniteReasoningParser(MarkerReasoningParser):
    start_markers = ("Here is my thought process:", "Here's my thought process:")
    end_markers = ("Here is my response:", "Here's my response:")
    start_at_beginning = True
    anchor = "<|start_of_role|>assistant<|end_of_role|>"
