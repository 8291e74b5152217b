"""`llmhal serve` with the clients people use, unmodified: the official `openai` SDK (each answer and
stream chunk validated with the SDK's own types) and LangChain's `ChatOpenAI`, on a tiny model.

The tiny model is random: constrained answers (tools, response_format) are steered off whitespace
with logit_bias so a greedy answer closes its JSON within a few tokens."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel

from llmhal import LLM, SamplingParams
from llmhal.testing.http_client import running_server

openai = pytest.importorskip("openai")
from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402


class Pick(BaseModel):
    color: Literal["red", "blue"]
    ok: bool


TOOL = {"type": "function", "function": {"name": "pick", "description": "pick a color",
        "parameters": Pick.model_json_schema()}}  # fmt: skip
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(tiny_models):
    folder, _ = tiny_models("llama")
    llm = LLM(folder, dtype="float32", max_model_len=512)
    with running_server(llm, model_name="tiny") as (base, _):
        tok = llm.get_tokenizer()
        # No whitespace tokens: a random model's JSON then closes in a few greedy tokens.
        no_space = {str(i): -100 for i in range(len(tok)) if not tok.decode([i]).strip()}
        yield base, llm, no_space


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def completion_valid(data: dict) -> Completion:
    """Completion.model_validate, allowing the two nulls OpenAI's API and vLLM send that the SDK's
    type (generated for finished answers) cannot hold: ``finish_reason`` of a chunk mid-stream and
    the first prompt token's log-probability with ``echo``."""
    data = json.loads(json.dumps(data))
    for c in data["choices"]:
        c["finish_reason"] = c["finish_reason"] or "length"
        lp = c.get("logprobs")
        if lp:
            lp["token_logprobs"] = [x if x is not None else 0.0 for x in lp["token_logprobs"]]
            lp["top_logprobs"] = [x if x is not None else {} for x in lp["top_logprobs"]]
    return Completion.model_validate(data)


def test_completions_echo_and_streams(client, served):
    _, llm, _ = served
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    data = raw.http_response.json()
    Completion.model_validate(data)  # a finished answer validates as sent
    offline = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert raw.parse().choices[0].text == offline.outputs[0].text
    echo = client.completions.create(model="tiny", prompt="Hello", echo=True, logprobs=1, max_tokens=0)  # fmt: skip
    completion_valid(echo.to_dict())
    assert echo.choices[0].text == "Hello" and echo.choices[0].logprobs.token_logprobs[0] is None
    chunks = list(client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    for c in chunks:
        completion_valid(c.to_dict())
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens == len(offline.prompt_token_ids)  # fmt: skip


def test_chat_logprobs_and_stream_with_usage(client):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=HI, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    full = ChatCompletion.model_validate(raw.http_response.json())
    assert len(full.choices[0].logprobs.content) == 6
    assert all(len(e.top_logprobs) >= 1 for e in full.choices[0].logprobs.content)
    stream = client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=6, temperature=0, stream=True, logprobs=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = [ChatCompletionChunk.model_validate(c.to_dict()) for c in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens and not chunks[-1].choices


def test_tools_and_response_format(client, served):
    import jsonschema

    _, _, no_space = served
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=HI, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "pick"}},
        max_tokens=40, temperature=0,
    )  # fmt: skip
    answer = ChatCompletion.model_validate(raw.http_response.json())
    call = answer.choices[0].message.tool_calls[0]
    assert call.function.name == "pick"
    jsonschema.validate(json.loads(call.function.arguments), Pick.model_json_schema())
    parsed = client.chat.completions.parse(
        model="tiny", messages=HI, response_format=Pick, max_tokens=40, temperature=0, logit_bias=no_space,
    )  # fmt: skip
    assert isinstance(parsed.choices[0].message.parsed, Pick)


def test_errors_are_the_sdks_exceptions(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", temperature=-1)
    assert "temperature" in e.value.message and e.value.body["code"] == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=10_000)
    assert "maximum context length is 512 tokens" in e.value.message
    keyed = openai.OpenAI(base_url=client.base_url, api_key="x", max_retries=0)
    assert keyed.models.list().data[0].id == "tiny"


def test_langchain_chat_openai(served):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    base, _, no_space = served
    chat = ChatOpenAI(base_url=base + "/v1", api_key="unused", model="tiny", temperature=0,
                      max_tokens=6, max_retries=0)  # fmt: skip
    said = chat.invoke("hi")
    assert isinstance(said.content, str) and said.usage_metadata["output_tokens"] >= 1
    assert "".join(c.content for c in chat.stream("hi")) == said.content
    steered = ChatOpenAI(base_url=base + "/v1", api_key="unused", model="tiny", temperature=0,
                         max_tokens=40, max_retries=0, logit_bias=no_space)  # fmt: skip
    for method in ("function_calling", "json_schema"):
        got = steered.with_structured_output(Pick, method=method).invoke("pick a color")
        assert isinstance(got, Pick), method
    # json_mode: any JSON object; "{" and "}" favoured so the random model closes it at once.
    tok_ids = {t for s in ("{", "}") for t in served[1].get_tokenizer().encode(s, add_special_tokens=False)}  # fmt: skip
    braces = ChatOpenAI(base_url=base + "/v1", api_key="unused", model="tiny", temperature=0,
                        max_tokens=20, max_retries=0, logit_bias={**no_space, **{str(t): 100 for t in tok_ids}})  # fmt: skip
    got = braces.with_structured_output({"title": "any", "type": "object"}, method="json_mode").invoke("json please")  # fmt: skip
    assert isinstance(got, dict)
