"""``hunyuan_a13b``: Hunyuan-A13B, ``<think>\\nreasoning\\n</think>\\n<answer>\\nanswer\\n</answer>``.
The tags are not single tokens of Hunyuan's vocabulary (``<think>`` is three), so the id-based
answers read the decoded text (:mod:`llmhal.reasoning.markers`). An answer without ``<think>``
(thinking off) is all content; the content is the answer without its ``<answer>`` tags and the
newlines next to them, the reasoning without the newline next to each tag."""

from __future__ import annotations

from llmhal.reasoning.markers import MarkerReasoningParser, unwrap


class HunyuanA13BReasoningParser(MarkerReasoningParser):
    start_markers = ("<think>",)
    end_markers = ("</think>",)

    def _tidy(self, reasoning: str, content: str, ended: bool, final: bool) -> tuple[str, str]:
        reasoning = reasoning[1:] if reasoning.startswith("\n") else reasoning
        if reasoning.endswith("\n") and (ended or not final):
            reasoning = reasoning[:-1]  # the newline before </think> (or maybe before it)
        return reasoning, unwrap(content, "<answer>", "</answer>", final)
