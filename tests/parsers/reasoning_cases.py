"""Each reasoning parser's fixtures, from its family's documented output format (model cards,
chat templates, vLLM's parser docstrings): finished texts with the reasoning and content they
split into, and whether the reasoning is over by the end of each."""

from __future__ import annotations

from dataclasses import dataclass

# markers that are special tokens in their families' vocabularies (Hunyuan's and Granite's are
# plain text, <think> is added as R1's are: see conftest.py)
SPECIAL_TOKENS = ["[THINK]", "[/THINK]", "<|assistant|>", "<|start_of_role|>", "<|end_of_role|>"]


@dataclass
class ReasoningCase:
    parser: str
    text: str
    reasoning: str | None
    content: str | None
    ended: bool


C = ReasoningCase
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'  # fmt: skip
CASES = [
    C(
        "deepseek_r1",
        "The capital of France.</think>Paris.",
        "The capital of France.",
        "Paris.",
        True,
    ),  # fmt: skip
    C("qwen3", "<think>The capital.</think>\n\nParis.", "The capital.", "\n\nParis.", True),
    C("qwen3", "Paris.", None, "Paris.", False),
    C(
        "deepseek_v3",
        "The capital of France.</think>Paris.",
        "The capital of France.",
        "Paris.",
        True,
    ),  # fmt: skip
    C("deepseek_v3", "<think>hmm</think>Paris.", "hmm", "Paris.", True),
    C("deepseek_v3", "still thinking", "still thinking", None, False),
    C(
        "glm45",
        "\n<think>The user asks for a capital.</think>\nParis.",
        "The user asks for a capital.",
        "\n\nParis.",
        True,
    ),  # fmt: skip
    C("glm45", "Paris.", None, "Paris.", False),
    C("glm45", "<think>cut short", "cut short", None, False),
    C("mistral", "[THINK]The capital.[/THINK]Paris.", "The capital.", "Paris.", True),
    C("mistral", "Paris, no thinking.", None, "Paris, no thinking.", False),
    C(
        "ernie45",
        "The capital.\n</think>\n\n<response>\nParis.\n</response>\n",
        "The capital.\n",
        "Paris.",
        True,
    ),  # fmt: skip
    C("ernie45", "abc\n</think>\ndef", "abc\n", "def", True),
    C("ernie45", "only reasoning so far", "only reasoning so far", None, False),
    C(
        "hunyuan_a13b",
        "<think>\nThe capital.\n</think>\n<answer>\nParis.\n</answer>",
        "The capital.",
        "Paris.",
        True,
    ),  # fmt: skip
    C("hunyuan_a13b", "<answer>\nParis.\n</answer>", None, "Paris.", False),
    C("hunyuan_a13b", "<think>\nstill going", "still going", None, False),
    C(
        "granite",
        "Here is my thought process:\nThe capital.\nHere is my response:\nParis.",
        "\nThe capital.\n",
        "\nParis.",
        True,
    ),  # fmt: skip
    C("granite", "Here's my thought process: a Here's my response: b", " a ", " b", True),
    C(
        "granite",
        "Paris is the capital. Here is my response: none",
        None,
        "Paris is the capital. Here is my response: none",
        False,
    ),  # fmt: skip
    C(
        "gpt_oss",
        "<|channel|>analysis<|message|>User asks for a capital.<|end|><|start|>assistant<|channel|>final<|message|>Paris.<|return|>",
        "User asks for a capital.",
        "Paris.",
        True,
    ),  # fmt: skip
    C(
        "gpt_oss",
        "<|channel|>analysis<|message|>Need the weather.<|end|>" + CALL,
        "Need the weather.",
        CALL,
        False,
    ),  # fmt: skip
    C("gpt_oss", "<|channel|>final<|message|>Paris.<|return|>", None, "Paris.", True),
]
