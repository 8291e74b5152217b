"""Each tool-call parser's fixtures, written from its family's documented format (model cards,
chat templates, vLLM's parser docstrings): finished texts with the content and calls they hold,
and a chat-template snippet that renders an assistant turn's calls the way the family's template
does (the round trip). Loaded by conftest.py, which parametrizes the shared suite with them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string"}}}}}  # fmt: skip
REQUEST: dict[str, Any] = {"tools": [WEATHER, TIME], "tool_choice": "auto"}

PARIS = ("get_weather", {"city": "Paris", "days": 2})
UTC = ("get_time", {"zone": "UTC"})
# every marker of every family, added to the test tokenizer as special tokens
SPECIAL_TOKENS = [
    "<tool_call>", "</tool_call>", "<|python_tag|>", "<|python_start|>", "<|python_end|>",
    "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<|tool_call|>",
    "<|action_start|>", "<|action_end|>", "<|plugin|>", "<tool_calls>", "</tool_calls>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_end|>", "<|tool_call_argument_begin|>", "<arg_key>", "</arg_key>", "<arg_value>",
    "</arg_value>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>",
    "<|return|>", "<|constrain|>",
]  # fmt: skip


@dataclass
class ToolCase:
    parser: str
    text: str
    content: str | None
    calls: list[tuple[str, dict[str, Any]]]
    ids: list[str] = field(default_factory=list)  # call ids the format carries


def _c(parser: str, text: str, content: str | None, *calls: tuple[str, dict[str, Any]], ids: list[str] | None = None) -> ToolCase:  # fmt: skip
    return ToolCase(parser, text, content, list(calls), ids or [])


DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"
DS31_CALL = "<｜tool▁call▁begin｜>{}<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
W, T = '{"city": "Paris", "days": 2}', '{"zone": "UTC"}'

CASES = [
    _c(
        "hermes",
        f'Let me check.<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n<tool_call>{{"name": "get_time", "arguments": {T}}}</tool_call>',
        "Let me check.",
        PARIS,
        UTC,
    ),
    _c("hermes", "The weather is fine.", "The weather is fine."),
    _c("llama3_json", f'{{"name": "get_weather", "parameters": {W}}}', None, PARIS),
    _c(
        "llama3_json",
        f'<|python_tag|>{{"name": "get_weather", "parameters": {W}}}; {{"name": "get_time", "parameters": {T}}}',
        None,
        PARIS,
        UTC,
    ),
    _c(
        "llama3_json",
        f'Checking.<|python_tag|>{{"name": "get_time", "arguments": {T}}}',
        "Checking.",
        UTC,
    ),
    _c("llama3_json", "Paris is sunny {mostly}.", "Paris is sunny {mostly}."),
    _c("pythonic", "[get_weather(city='Paris', days=2), get_time(zone=\"UTC\")]", None, PARIS, UTC),
    _c(
        "pythonic",
        "[register(name='Martha\\'s, Vineyard', age=37, address={'city': 'SF', 'zip': [1, 2]}, role=None, ok=true)]",
        None,  # fmt: skip
        (
            "register",
            {
                "name": "Martha's, Vineyard",
                "age": 37,
                "address": {"city": "SF", "zip": [1, 2]},
                "role": None,
                "ok": True,
            },
        ),
    ),
    _c("pythonic", "[now()]", None, ("now", {})),
    _c("pythonic", "[1] is a footnote, not a call.", "[1] is a footnote, not a call."),
    _c(
        "llama4_pythonic",
        '<|python_start|>[get_weather(city="Paris", days=2)]<|python_end|>',
        None,
        PARIS,
    ),
    _c("llama4_pythonic", '[get_time(zone="UTC")]', None, UTC),
    _c(
        "mistral",
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}, {{"name": "get_time", "arguments": {T}}}]',
        None,
        PARIS,
        UTC,
    ),
    _c(
        "mistral",
        f"Sure.[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]get_time[ARGS]{T}",
        "Sure.",
        PARIS,
        UTC,
    ),
    _c("mistral", f"[TOOL_CALLS]get_weather{W}", None, PARIS),
    _c("mistral", f"[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{T}", None, UTC, ids=["a1B2c3D4e"]),
    _c(
        "qwen3_coder",
        "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        "I'll check.\n",
        PARIS,
    ),
    _c(
        "qwen3_coder",
        "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        None,
        UTC,
        PARIS,
    ),
    _c(
        "deepseek_v3",
        "Checking.<｜tool▁calls▁begin｜>"
        + DS_CALL.format("get_weather", W)
        + "\n"
        + DS_CALL.format("get_time", T)
        + "<｜tool▁calls▁end｜>",
        "Checking.",
        PARIS,
        UTC,
    ),
    _c(
        "deepseek_v31",
        "<｜tool▁calls▁begin｜>"
        + DS31_CALL.format("get_weather", W)
        + DS31_CALL.format("get_time", T)
        + "<｜tool▁calls▁end｜>",
        None,
        PARIS,
        UTC,
    ),
    _c("granite", f'<|tool_call|>[{{"name": "get_weather", "arguments": {W}}}]', None, PARIS),
    _c(
        "granite",
        f'<tool_call>[{{"name": "get_weather", "arguments": {W}}}, {{"name": "get_time", "arguments": {T}}}]',
        None,
        PARIS,
        UTC,
    ),
    _c(
        "internlm",
        f'Let me check.<|action_start|><|plugin|>\n{{"name": "get_weather", "parameters": {W}}}<|action_end|>',
        "Let me check.",
        PARIS,
    ),
    _c(
        "jamba",
        f' <tool_calls>[{{"name": "get_weather", "arguments": {W}}}, {{"name": "get_time", "arguments": {T}}}]</tool_calls>',
        None,
        PARIS,
        UTC,
    ),
    _c(
        "kimi_k2",
        f"Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{W}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{T}<|tool_call_end|><|tool_calls_section_end|>",
        "Checking.",
        PARIS,
        UTC,
        ids=["functions.get_weather:0", "functions.get_time:1"],
    ),
    _c(
        "glm45",
        "<tool_call>get_time<arg_key>zone</arg_key><arg_value>UTC</arg_value></tool_call><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>",
        None,
        UTC,
        PARIS,
    ),  # GLM-4.7's shape
    _c(
        "glm45",
        "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
        "Checking.\n",
        PARIS,
    ),
    _c(
        "openai",
        f"<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{W}<|call|>",
        None,
        PARIS,
    ),
    _c(
        "openai",
        f"<|channel|>commentary to=functions.get_time<|constrain|>json<|message|>{T}<|call|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{W}<|call|>",
        None,
        UTC,
        PARIS,
    ),
    _c(
        "openai",
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
        "It is sunny.",
    ),
    _c(
        "xlam",
        f'[{{"name": "get_weather", "arguments": {W}}}, {{"name": "get_time", "arguments": {T}}}]',
        None,
        PARIS,
        UTC,
    ),
    _c(
        "xlam",
        f'Here you go:\n```json\n[{{"name": "get_time", "arguments": {T}}}]\n```',
        "Here you go:\n",
        UTC,
    ),
    _c(
        "xlam",
        f'<think>which tool?</think>\n[{{"name": "get_time", "arguments": {T}}}]',
        "<think>which tool?</think>\n",
        UTC,
    ),
    _c(
        "phi4_mini_json",
        f'functools[{{"name": "get_weather", "arguments": {W}}}, {{"name": "get_time", "arguments": {T}}}]',
        None,
        PARIS,
        UTC,
    ),
]

# Each family's chat template, the part that renders an assistant turn's calls (arguments are
# dicts, as transformers passes them), written after the published templates (InternLM2's writes
# "arguments" where the model writes "parameters"; both are read). Phi-4-mini's template writes
# past calls without their functools[...] wrapper, a form no parser reads (vLLM's neither): its
# snippet renders the form its system prompt asks the model to write.
_EACH = "{%- for m in messages if m.role == 'assistant' %}{%- for tc in m.tool_calls %}"
_END = "{%- endfor %}{%- endfor %}"
_ARGS = "{{ tc.function.arguments | tojson }}"
_TEXT_ARGS = "{%- for k, v in tc.function.arguments.items() %}"
TEMPLATES = {
    "hermes": _EACH
    + '<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": '
    + _ARGS
    + "}\n</tool_call>"
    + _END,  # fmt: skip
    "llama3_json": _EACH
    + '{%- if not loop.first %}; {% endif %}{"name": "{{ tc.function.name }}", "parameters": '
    + _ARGS
    + "}"
    + _END
    + "<|eot_id|>",  # fmt: skip
    "pythonic": "["
    + _EACH
    + "{%- if not loop.first %}, {% endif %}{{ tc.function.name }}("
    + _TEXT_ARGS
    + '{%- if not loop.first %}, {% endif %}{{ k }}={{ "%r" | format(v) }}{%- endfor %})'
    + _END
    + "]",  # fmt: skip
    "llama4_pythonic": "<|python_start|>["
    + _EACH
    + "{%- if not loop.first %}, {% endif %}{{ tc.function.name }}("
    + _TEXT_ARGS
    + "{%- if not loop.first %}, {% endif %}{{ k }}={{ v | tojson }}{%- endfor %})"
    + _END
    + "]<|python_end|>",  # fmt: skip
    "mistral": _EACH + "[TOOL_CALLS]{{ tc.function.name }}[ARGS]" + _ARGS + _END + "</s>",
    "qwen3_coder": _EACH
    + "<tool_call>\n<function={{ tc.function.name }}>\n"
    + _TEXT_ARGS
    + "<parameter={{ k }}>\n{{ v if v is string else v | tojson }}\n</parameter>\n{%- endfor %}\n</function>\n</tool_call>"
    + _END,  # fmt: skip
    "deepseek_v3": "<｜tool▁calls▁begin｜>"
    + _EACH
    + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ tc.function.name }}\n```json\n"
    + _ARGS
    + "\n```<｜tool▁call▁end｜>"
    + _END
    + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",  # fmt: skip
    "deepseek_v31": "<｜tool▁calls▁begin｜>"
    + _EACH
    + "<｜tool▁call▁begin｜>{{ tc.function.name }}<｜tool▁sep｜>"
    + _ARGS
    + "<｜tool▁call▁end｜>"
    + _END
    + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",  # fmt: skip
    "granite": "{%- for m in messages if m.role == 'assistant' %}<|tool_call|>{{ m.tool_calls | map(attribute='function') | list | tojson }}{%- endfor %}",  # fmt: skip
    "internlm": _EACH
    + '<|action_start|><|plugin|>\n{"name": "{{ tc.function.name }}", "arguments": '
    + _ARGS
    + "}<|action_end|>"
    + _END,  # fmt: skip
    "jamba": "{%- for m in messages if m.role == 'assistant' %}<tool_calls>{{ m.tool_calls | map(attribute='function') | list | tojson }}</tool_calls>{%- endfor %}",  # fmt: skip
    "kimi_k2": "<|tool_calls_section_begin|>"
    + _EACH
    + "<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>"
    + _ARGS
    + "<|tool_call_end|>"
    + _END
    + "<|tool_calls_section_end|>",  # fmt: skip
    "glm45": _EACH
    + "<tool_call>{{ tc.function.name }}\n"
    + _TEXT_ARGS
    + "<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v if v is string else v | tojson }}</arg_value>\n{%- endfor %}</tool_call>"
    + _END,  # fmt: skip
    "openai": _EACH
    + "<|start|>assistant<|channel|>commentary to=functions.{{ tc.function.name }} <|constrain|>json<|message|>"
    + _ARGS
    + "<|call|>"
    + _END,  # fmt: skip
    "xlam": "{%- for m in messages if m.role == 'assistant' %}{{ m.tool_calls | map(attribute='function') | list | tojson }}{%- endfor %}",  # fmt: skip
    "phi4_mini_json": "{%- for m in messages if m.role == 'assistant' %}functools{{ m.tool_calls | map(attribute='function') | list | tojson }}{%- endfor %}",  # fmt: skip
}
