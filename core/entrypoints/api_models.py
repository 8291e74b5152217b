"""The server's request and response bodies as pydantic models, in the shapes vLLM serves.

They are the ``/openapi.json`` document and the typed view of a request. Unknown fields are
allowed (vLLM's ``extra="allow"``): the server ignores them and logs each name once. The sampling
values are checked by :mod:`llmhal.entrypoints.openai_protocol` first, with messages that name the
field and its rule; these models then check the structure of the rest. Fields marked "accepted,
ignored" are what vLLM accepts without acting on them (or what llmhal has no feature for).
Imported by the server only (pydantic is the ``serve`` extra).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_INT64 = {"ge": -(2**63), "le": 2**63 - 1}


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(OpenAIBaseModel):
    """The fields both generation endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = 1
    best_of: int | None = Field(None, description="accepted; n completions are returned (vLLM)")
    presence_penalty: float | None = None
    seed: int | None = Field(None, **_INT64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = Field(None, description="accepted, ignored")
    response_format: dict[str, Any] | None = None
    # vLLM's sampling extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = Field(True, description="accepted, ignored")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="keep only the prompt's last N tokens (-1: max_model_len)"
    )
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    use_beam_search: bool = Field(False, description="not supported: true is a 400")
    length_penalty: float = Field(1.0, description="accepted, ignored (beam search only)")
    # vLLM's other extras
    structured_outputs: dict[str, Any] | None = None
    priority: int = Field(
        0, **_INT64, description="lower runs first; needs --scheduling-policy priority"
    )
    request_id: str | None = Field(None, description="the response id's suffix")
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = Field(None, description="not supported: a 400, as in vLLM")
    add_special_tokens: bool = True


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = Field(True, description="accepted, ignored")
    reasoning_effort: str | None = Field(None, description="accepted, ignored")
    store: bool | None = Field(None, description="accepted, ignored")
    metadata: dict[str, Any] | None = Field(None, description="accepted, ignored")
    service_tier: str | None = Field(None, description="accepted, ignored")
    functions: list[dict[str, Any]] | None = Field(None, description="accepted, ignored")
    function_call: str | dict[str, Any] | None = Field(None, description="accepted, ignored")
    echo: bool = Field(False, description="prepend the last message when it has the answer's role")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = Field(None, description="needs --trust-request-chat-template")
    chat_template_kwargs: dict[str, Any] | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int | None = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogProbs(OpenAIBaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_ids: list[int] | None = None
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogProb(OpenAIBaseModel):
    token: str
    token_id: int | None = None
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCall(OpenAIBaseModel):
    id: str | None = None
    type: Literal["function"] | None = "function"
    index: int | None = None
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    """One ``data:`` event of a chat stream (a completions stream's events are
    :class:`CompletionResponse` shapes, ``usage`` null until the last)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # in a choice's first chunk


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llmhal"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    return_token_strs: bool | None = None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
