"""``mistral``: Mistral models' ``[TOOL_CALLS]`` (a special token) followed by either a JSON list
``[{"name": ..., "arguments": {...}}]`` (tokenizers before v11) or, from v11 on, one
``name[ARGS]{...}`` per call, each after its own ``[TOOL_CALLS]`` (v13 may put
``[CALL_ID]id`` before ``[ARGS]``; ``name{...}`` without ``[ARGS]`` is read too, for a text
whose special tokens were skipped). The text before the first ``[TOOL_CALLS]`` is the content.

Call ids are 9 letters and digits, the only shape Mistral's chat templates accept when the calls
come back in the next request's messages.
"""

from __future__ import annotations

import random
import string
from typing import Any

from llmhal.tool_parsers.base import ToolCall
from llmhal.tool_parsers.incremental import SectionToolParser, make_call
from llmhal.tool_parsers.values import _DECODER, calls_from_objects, json_list_calls

BOT, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(random.choices(_ALNUM, k=9))


def _with_id(call: ToolCall, call_id: str | None = None) -> ToolCall:
    call.id = call_id or mistral_call_id()
    return call


class MistralToolParser(SectionToolParser):
    markers = (BOT,)

    def calls(self, section: str, request: dict[str, Any], final: bool) -> list[ToolCall]:
        out: list[ToolCall] = []
        for block in section.split(BOT)[1:]:
            if block.lstrip().startswith(("[", "{")):  # the JSON form
                objs = json_list_calls(block) if block.lstrip().startswith("[") else calls_from_objects([_first_json(block)])  # fmt: skip
                out += [_with_id(c) for c in objs]
                continue
            name, sep, rest = block.partition(ARGS)
            if not sep:  # [ARGS] dropped from the text (special tokens skipped): name{...}
                brace = block.find("{")
                if brace <= 0:
                    continue  # the name is still being written (or malformed)
                name, rest = block[:brace], block[brace:]
            call_id = None
            if CALL_ID in name:
                name, _, call_id = name.partition(CALL_ID)
            try:
                args, _ = _DECODER.raw_decode(rest.lstrip())
                out.append(make_call(name, args, call_id or mistral_call_id()))
            except ValueError:
                continue  # unfinished or malformed arguments
        return out


def _first_json(text: str) -> Any:
    try:
        return _DECODER.raw_decode(text.lstrip())[0]
    except ValueError:
        return None
