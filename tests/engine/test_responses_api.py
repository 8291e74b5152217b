"""/v1/responses through the official openai SDK (client.responses.create / stream / retrieve /
cancel / delete), every answer and event validated with the SDK's own types, on a tiny model whose
tokenizer has <think> tags, served with the hermes tool parser and the deepseek_r1 reasoning
parser; its answers are forced with a structured-output regex where a test needs a given text."""

from __future__ import annotations

import json
import time

import pytest

from llmhal import LLM
from llmhal.testing.http_client import post_json, running_server
from llmhal.testing.tiny_models import make_tiny_model, make_tokenizer

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"], "additionalProperties": False}}  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = make_tokenizer(382)
    tok.add_tokens(["<think>", "</think>"])
    folder = tmp_path_factory.mktemp("responses")
    make_tiny_model(folder, "llama")
    tok.save_pretrained(folder)
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    kw = {"reasoning_parser": "deepseek_r1", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}  # fmt: skip
    with running_server(llm, model_name="tiny", **kw) as (base, _):
        yield base, llm


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def forced(regex: str) -> dict:
    return {"structured_outputs": {"regex": regex}}


def test_plain_reasoning_and_retrieve(client):
    resp = client.responses.create(
        model="tiny", input="capital of France?", instructions="Be brief.", max_output_tokens=40,
        temperature=0, extra_body=forced("Let me see[.]</think>It is Paris[.]"),
    )  # fmt: skip
    Response.model_validate(resp.to_dict())
    assert resp.status == "completed" and resp.object == "response"
    kinds = [i.type for i in resp.output]
    assert kinds == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "Let me see."
    assert resp.output_text == "It is Paris."
    u = resp.usage
    assert u.output_tokens > u.output_tokens_details.reasoning_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    again = client.responses.retrieve(resp.id)
    assert again.model_dump() == resp.model_dump()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")


def test_max_output_tokens_makes_it_incomplete(client):
    resp = client.responses.create(model="tiny", input=[{"role": "user", "content": "hi"}], max_output_tokens=3)  # fmt: skip
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3


def test_a_stream_of_typed_events(client):
    kw = {"model": "tiny", "input": "capital?", "max_output_tokens": 40, "temperature": 0,
          "extra_body": forced("Hm[.]</think>Paris[.]")}  # fmt: skip
    events = list(client.responses.create(stream=True, **kw))
    for e in events:
        EVENT.validate_python(e.model_dump())
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Hm."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Paris."
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == "Paris."  # fmt: skip
    assert client.responses.retrieve(final.id).output_text == "Paris."
    # The SDK's stream helper puts the same answer together from the events.
    with client.responses.stream(**kw) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == "Paris."


def test_function_calls_through_the_tool_parser(client):
    call = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Rome"\}\}</tool_call>'
    kw = {"model": "tiny", "input": "weather?", "tools": [WEATHER], "max_output_tokens": 120,
          "extra_body": forced("</think>" + call)}  # fmt: skip
    resp = client.responses.create(**kw)
    Response.model_validate(resp.to_dict())
    assert resp.status == "completed", resp.output
    (fc,) = [i for i in resp.output if i.type == "function_call"]
    assert (fc.name, json.loads(fc.arguments)) == ("get_weather", {"city": "Rome"})
    events = list(client.responses.create(stream=True, **kw))
    for e in events:
        EVENT.validate_python(e.model_dump())
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Rome"}
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == args
    # The call's result goes back as a function_call_output item, continuing the conversation.
    follow = client.responses.create(
        model="tiny", previous_response_id=resp.id, max_output_tokens=20, temperature=0,
        input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "sunny"}],
        extra_body=forced("</think>Sunny[.]"),
    )  # fmt: skip
    assert follow.output_text == "Sunny." and follow.previous_response_id == resp.id


def test_named_tool_choice_and_structured_output(client):
    resp = client.responses.create(
        model="tiny", input="weather?", tools=[WEATHER], max_output_tokens=60,
        tool_choice={"type": "function", "name": "get_weather"},
    )  # fmt: skip
    (fc,) = resp.output
    assert fc.type == "function_call" and json.loads(fc.arguments)["city"] in ("Paris", "Rome")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    text = {"format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}}
    out = client.responses.create(model="tiny", input="a digit", text=text, max_output_tokens=60)
    Response.model_validate(out.to_dict())
    assert set(json.loads(out.output_text)) == {"n"}
    # The SDK's own structured output: a pydantic class as text_format, the answer parsed into it.
    from pydantic import BaseModel, Field

    class Digit(BaseModel):
        n: int = Field(ge=0, le=9)

    parsed = client.responses.parse(model="tiny", input="a digit", text_format=Digit, max_output_tokens=60)  # fmt: skip
    assert isinstance(parsed.output_parsed, Digit)


def test_two_turns_with_previous_response_id(served, client):
    base, llm = served
    first = client.responses.create(model="tiny", input="Say A.", max_output_tokens=20, extra_body=forced("</think>A[.]"))  # fmt: skip
    second = client.responses.create(model="tiny", input="Again.", previous_response_id=first.id, max_output_tokens=8, temperature=0)  # fmt: skip
    Response.model_validate(second.to_dict())
    # The second turn's prompt is the whole conversation: its user turn, the answer, the new turn.
    msgs = [{"role": "user", "content": "Say A."}, {"role": "assistant", "content": "A."}, {"role": "user", "content": "Again."}]  # fmt: skip
    prompt = llm.apply_chat_template(msgs, True)
    assert second.usage.input_tokens == len(llm.get_tokenizer().encode(prompt))
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_gone")
    unstored = client.responses.create(model="tiny", input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_background_then_cancel(served, client):
    base, llm = served
    resp = client.responses.create(model="tiny", input="go", background=True, max_output_tokens=200, extra_body={"ignore_eos": True})  # fmt: skip
    assert resp.status in ("queued", "in_progress") and resp.background
    cancelled = client.responses.cancel(resp.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(resp.id).status == "cancelled"
    deadline = time.time() + 30
    while llm.engine.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.05)
    assert not llm.engine.has_unfinished_requests()  # its request was aborted
    done = client.responses.create(model="tiny", input="go", background=True, max_output_tokens=4)
    while (got := client.responses.retrieve(done.id)).status in ("queued", "in_progress"):
        time.sleep(0.05)
    assert got.status == "incomplete" and got.usage.output_tokens == 4
    synchronous = client.responses.create(model="tiny", input="go", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        client.responses.cancel(synchronous.id)


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token(served):
    base, _ = served  # found by schemathesis: every token was dropped, and sampling failed
    status, resp = post_json(base + "/v1/responses", {"input": "", "top_p": 5e-324, "max_output_tokens": 2})  # fmt: skip
    assert status == 200 and resp["usage"]["output_tokens"] == 2, resp


def test_refusals_name_the_remedy(served):
    base, _ = served
    cases = [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input_text",
        ),  # fmt: skip
        ({"input": "x", "tools": [{"type": "web_search"}]}, "function tools only"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "json_schema"),
        ({"instructions": "x"}, "input is required"),
        ({"input": "x", "background": True, "store": False}, "must be stored"),
    ]
    for body, words in cases:
        status, resp = post_json(base + "/v1/responses", body)
        assert status == 400 and words in resp["error"]["message"], (body, resp)


def test_a_client_that_hangs_up_mid_stream_stops_its_request(served):
    import http.client
    import urllib.parse
    import urllib.request

    base, llm = served

    def aborted() -> float:
        text = urllib.request.urlopen(base + "/metrics").read().decode()
        return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith("vllm:request_success_total") and 'reason="abort"' in x)  # fmt: skip

    before = aborted()
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    body = {"input": "go", "stream": True, "max_output_tokens": 200, "ignore_eos": True}
    conn.request("POST", "/v1/responses", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    deltas = 0
    for line in resp:
        # (all reasoning: this model's text has no </think> tag unless forced)
        deltas += line.startswith(b"event: response.") and line.rstrip().endswith(b".delta")
        if deltas == 3:
            break
    conn.close()
    deadline = time.time() + 30
    while llm.engine.has_unfinished_requests() and time.time() < deadline:
        time.sleep(0.05)
    assert not llm.engine.has_unfinished_requests()
    assert aborted() == before + 1  # ended by the hang-up, not by its 200 tokens
