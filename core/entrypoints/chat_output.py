"""A chat choice's text as OpenAI's message: reasoning split off by the server's reasoning parser
(``reasoning_content``, and vLLM's newer ``reasoning`` with the same text), then tool calls read
from what remains (:mod:`llmhal.entrypoints.chat_tools`). Streams get the same pieces as deltas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmhal.entrypoints.chat_tools import ToolPlan, ToolStream


def splits_reasoning(
    reasoning_cls: Any, tokenizer: Any, structured: Any, gated: bool, prompt_ids: Sequence[int]
) -> Any:
    """The reasoning parser a chat answer is split with, or None when all of it is content:
    without the engine's reasoning gate (``gated``), a JSON-constrained answer (response_format,
    a named or required tool_choice) is JSON from its first token (a regex or grammar may spell
    out a reasoning part, and is split as usual); and a prompt that already ended the reasoning
    (a template turning thinking off) leaves none to split (vLLM checks the prompt ids the same
    way)."""
    if reasoning_cls is None:
        return None
    is_json = structured is not None and (structured.json is not None or structured.json_object is not None)  # fmt: skip
    if is_json and not gated:
        return None
    return None if reasoning_cls(tokenizer).is_reasoning_end(prompt_ids) else reasoning_cls


def content_ids(reasoning_parser: Any, ids: Sequence[int] | None) -> list[int] | None:
    """The ids of the content after the reasoning (vLLM's ``extract_content_ids``), or None."""
    get = getattr(reasoning_parser, "extract_content_ids", None)
    if ids is None or get is None:
        return None
    try:
        return list(get(list(ids)))
    except Exception:  # a plugin's: the tool parser then reads the text alone
        return None


class ChatOutput:
    def __init__(
        self, tools: ToolPlan | None, reasoning_cls: Any, tokenizer: Any, body: dict[str, Any]
    ) -> None:
        self.tools, self.reasoning_cls, self.tokenizer, self.body = tools, reasoning_cls, tokenizer, body  # fmt: skip

    def message(self, text: str, finish: str | None, ids: Sequence[int] | None = None) -> tuple[dict[str, Any], str | None]:  # fmt: skip
        """(the message, the finish reason) of a finished choice; ``ids``: its token ids, for
        the tool-call parser."""
        msg: dict[str, Any] = {"role": "assistant"}
        if self.reasoning_cls is not None:
            parser = self.parser()
            reasoning, text = parser.extract_reasoning(text, self.body)
            text = text or ""
            msg["reasoning_content"] = msg["reasoning"] = reasoning
            ids = content_ids(parser, ids)
        msg["content"] = text
        if self.tools is not None:
            content, calls, finish = self.tools.final(text, finish, self.body, ids)
            msg["content"], msg["tool_calls"] = content, [c.to_dict() for c in calls]
        return msg, finish

    def parser(self) -> Any:
        """A reasoning parser for this request; it gets the request's chat_template_kwargs, as
        vLLM's do (a hybrid model's parser reads whether thinking was turned on)."""
        kwargs = self.body.get("chat_template_kwargs") if isinstance(self.body, dict) else None
        return self.reasoning_cls(self.tokenizer, chat_template_kwargs=kwargs or {})

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: each update's (content, reasoning, tool-call deltas, finish)."""

    def __init__(self, out: ChatOutput) -> None:
        self.reasoning = out.parser() if out.reasoning_cls is not None else None
        self.tools = ToolStream(out.tools, out.body) if out.tools is not None else None
        self.text, self.content = "", ""
        self.ids: list[int] = []
        self._sent = 0  # characters of content sent (when no tool handling does it)

    def step(self, text: str, ids: list[int], finish: str | None) -> tuple[str, str, list[Any], str | None]:  # fmt: skip
        prev, self.text = self.text, text
        reasoning = ""
        if self.reasoning is None:
            self.content = text
        else:
            prev_ids, self.ids = self.ids, ids
            pieces = [self.reasoning.extract_reasoning_streaming(prev, text, text[len(prev) :], prev_ids, ids, ids[len(prev_ids) :])]  # fmt: skip
            flush = getattr(
                self.reasoning, "flush", None
            )  # llmhal's parsers; vLLM-style plugins lack it
            if finish is not None and flush is not None:
                pieces.append(flush(text))
            for dm in filter(None, pieces):
                reasoning += dm.reasoning or ""
                self.content += dm.content or ""
        if self.tools is None:
            delta, self._sent = self.content[self._sent :], len(self.content)
            return delta, reasoning, [], finish
        if self.reasoning is not None:
            ids = content_ids(self.reasoning, ids) or []
        delta, calls, finish = self.tools.step(self.content, ids, finish)
        return delta, reasoning, calls, finish
