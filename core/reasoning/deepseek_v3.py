"""``deepseek_v3``: DeepSeek-V3.1/V3.2, hybrid models whose chat template thinks or not as the
request's ``chat_template_kwargs`` say (``thinking``, or ``enable_thinking``). Thinking on, the
template opens ``<think>`` and the answer splits as R1's does; thinking off (said so), it is all
content, as in vLLM. Not said, R1's split applies: the template then writes ``</think>`` into a
prompt that does not think, and the server, finding the reasoning ended in the prompt, leaves
the whole answer as content."""

from __future__ import annotations

from typing import Any

from llmhal.reasoning.parsers import DeepSeekR1ReasoningParser


def thinking_flag(kwargs: Any) -> bool | None:
    """``thinking`` (DeepSeek's name) or ``enable_thinking`` (Qwen's) of chat_template_kwargs."""
    if not isinstance(kwargs, dict):
        return None
    flag = kwargs.get("thinking", kwargs.get("enable_thinking"))
    return None if flag is None else bool(flag)


def request_kwargs(request: Any) -> Any:
    """A request's chat_template_kwargs, whether it is a dict or a request object."""
    if isinstance(request, dict):
        return request.get("chat_template_kwargs")
    return getattr(request, "chat_template_kwargs", None)


class DeepSeekV3ReasoningParser(DeepSeekR1ReasoningParser):
    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        self.thinking = thinking_flag(kwargs.get("chat_template_kwargs"))

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self.thinking is False:
            return "", text
        return super()._split(text, final)

    def extract_reasoning(
        self, model_output: str, request: Any = None
    ) -> tuple[str | None, str | None]:
        flag = thinking_flag(request_kwargs(request))
        if flag is not None:
            self.thinking = flag
        return super().extract_reasoning(model_output, request)
