"""Structured outputs through the engine, for both backends, on a tiny random model: every output
is checked by an independent reference (jsonschema for JSON, re.fullmatch for regexes), with
random sampling so the model's whims explore the grammar; plus the params' and backends' errors."""

from __future__ import annotations

import json
import math
import re

import pytest

from llmhal import LLM, SamplingParams
from llmhal.structured_output import StructuredOutputsParams as S
from llmhal.structured_output.backend import apply_token_bitmask, bitmask_words
from llmhal.structured_output.manager import StructuredOutputManager
from llmhal.utils.imports import MissingDependencyError

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
BACKENDS = ["xgrammar", "guidance"]


@pytest.fixture(scope="module")
def llms(tiny_models):
    folder, _ = tiny_models("llama")
    made = {}

    def get(backend: str = "auto") -> LLM:
        if backend not in made:
            made[backend] = LLM(
                folder, dtype="float32", max_model_len=256,
                structured_outputs_config={"backend": backend},
            )  # fmt: skip
        return made[backend]

    return get


def sample(llm: LLM, so: S, n: int = 4, max_tokens: int = 120, **kw) -> list:
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=so, **kw)
        for s in range(n)
    ]
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": [5, 6, 7]}] * n, params)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_outputs_follow_the_schema(llms, backend):
    outs = sample(llms(backend), S(json=SCHEMA, disable_any_whitespace=True))
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > 1  # sampled, not one forced path


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_object_regex_choice_and_grammar(llms, backend):
    llm = llms(backend)
    for o in sample(llm, S(json_object=True, disable_any_whitespace=True), max_tokens=200):
        if o.finish_reason == "stop":  # a random model may nest objects past max_tokens
            assert isinstance(json.loads(o.text), dict)
    for o in sample(llm, S(regex=r"[a-c]{2,4}-\d{3}")):
        assert o.finish_reason == "stop" and re.fullmatch(r"[a-c]{2,4}-\d{3}", o.text), o.text
    choices = ["alpha", "beta gamma", "δέλτα"]  # multi-byte characters too
    outs = sample(llm, S(choice=choices), n=8)
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs)
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    for o in sample(llm, S(grammar=grammar)):
        assert o.finish_reason == "stop" and re.fullmatch(r"\(([0-9x])(,[0-9x])*\)", o.text), o.text


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_with_ignore_eos_ends_when_the_output_is_complete(llms, backend):
    llm = llms(backend)
    so = S(regex=r"[0-9]{5}")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, structured_outputs=so)
    (out,) = llm.generate({"prompt_token_ids": [9, 8]}, params)
    assert re.fullmatch(r"[0-9]{5}", out.outputs[0].text)
    assert out.outputs[0].finish_reason == "stop"


def test_preempted_requests_resume_their_grammar(tiny_models):
    folder, _ = tiny_models("llama")
    so = S(json=SCHEMA, disable_any_whitespace=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + k))} for k in (4, 9, 13, 6)]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=so) for s in range(4)]  # fmt: skip
    roomy = LLM(folder, dtype="float32", max_model_len=128)
    tight = LLM(folder, dtype="float32", max_model_len=128, block_size=4,
                kv_cache_memory_bytes=tight_bytes(roomy, 24))  # fmt: skip
    a = [o.outputs[0].text for o in roomy.generate(prompts, params)]
    b = [o.outputs[0].text for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert a == b
    for text in a:
        jsonschema.validate(json.loads(text), SCHEMA)


def tight_bytes(llm: LLM, blocks: int) -> int:
    """KV-cache bytes for ``blocks`` blocks of 4 tokens of ``llm``'s model."""
    per_token = llm.engine.runner.kv_cache_bytes_per_block() // llm.engine.config.cache.block_size
    return per_token * 4 * blocks


def test_logprobs_are_those_of_the_constrained_distribution(llms):
    llm = llms("xgrammar")
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, structured_outputs=S(choice=["ab", "ba"]))  # fmt: skip
    (out,) = llm.generate({"prompt_token_ids": [5, 6]}, params)
    tok = llm.get_tokenizer()
    first = out.outputs[0].logprobs[0]
    allowed = {t for t in first if first[t].logprob > -math.inf}
    assert all(tok.decode([t]) in ("a", "b", "ab", "ba") for t in allowed)
    assert len(allowed) <= 5  # so all of them are among the top 5: their mass is the whole
    assert math.isclose(sum(math.exp(first[t].logprob) for t in allowed), 1.0, rel_tol=1e-4)


def test_auto_falls_back_to_guidance_for_what_xgrammar_does_not_enforce(llms):
    schema = {"type": "string", "pattern": "^[ab]+$", "maxLength": 3}
    so = S(json=schema, disable_any_whitespace=True)
    for o in sample(llms("auto"), so, max_tokens=20):
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), schema)
    with pytest.raises(ValueError, match="xgrammar does not enforce minLength/maxLength"):
        llms("xgrammar").generate("x", SamplingParams(structured_outputs=so))
    # Neither enforces "not": refused, with each backend's reason.
    with pytest.raises(ValueError, match="xgrammar does not enforce not.*Unimplemented keys"):
        llms("auto").generate("x", SamplingParams(structured_outputs=S(json={"not": {"type": "integer"}})))  # fmt: skip


@pytest.mark.parametrize(
    "schema, found",
    [
        ({"type": "array", "contains": {"const": 5}}, ["contains"]),
        ({"properties": {"not": {"type": "integer"}, "if": {"format": "email"}}}, []),
        ({"properties": {"a": {"anyOf": [{"format": "nope"}]}}}, ["format 'nope'"]),
        ({"$defs": {"x": {"if": {}, "then": {}}}, "enum": [{"not": 1}]}, ["if", "then"]),
        ({"type": "string", "format": "email", "minLength": 3}, ["minLength/maxLength with pattern or format"]),
    ],
)  # fmt: skip
def test_the_keywords_xgrammar_ignores_are_found_where_they_are_keywords(schema, found):
    from llmhal.structured_output.xgrammar_backend import unenforced_keywords

    assert unenforced_keywords(schema) == found


def test_bad_constraints_are_refused_before_any_work(llms):
    llm = llms("auto")
    good = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    bad = SamplingParams(structured_outputs=S(regex="(unclosed"))
    with pytest.raises(ValueError, match="no structured-output backend can serve"):
        llm.generate(["a", "b"], [good, bad])
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate("a", good)[0].outputs[0].token_ids) == 3  # still usable


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"json": {"type": "object"}, "regex": "a"}, "only use one kind"),
        ({}, "must use one kind"),
        ({"choice": []}, "non-empty list"),
        ({"choice": "ab"}, "list of strings"),
        ({"json_object": False}, "must be True"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": "  "}, "cannot be an empty string"),
        ({"regex": "a\0b"}, "NUL"),
        ({"grammar": ""}, "cannot be an empty string"),
    ],
)
def test_params_errors_say_what_is_wrong(kwargs, words):
    with pytest.raises(ValueError, match=words):
        S(**kwargs)


def test_params_from_a_dict_and_their_key():
    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert p.structured_outputs == S(choice=("a", "b"))
    with pytest.raises(ValueError, match="does not support: structural_tag"):
        SamplingParams(structured_outputs={"structural_tag": "{}"})
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs=42)
    kind, spec = S(json={"b": 1, "a": 2}).key()
    assert kind.value == "json" and spec == '{"a": 2, "b": 1}'


def test_backend_names_are_checked_before_the_model_loads(tiny_models):
    folder, _ = tiny_models("llama")
    with pytest.raises(ValueError, match="not implemented in llmhal"):
        LLM(folder, structured_outputs_config={"backend": "outlines"})
    with pytest.raises(ValueError, match="unknown structured-output backend 'nope'"):
        LLM(folder, structured_outputs_config={"backend": "nope"})
    with pytest.raises(ValueError, match="takes"):
        LLM(folder, structured_outputs_config={"backend": "auto", "reasoning_parser": "x"})


def test_a_missing_library_is_named_and_auto_uses_the_other(llms, monkeypatch):
    import llmhal.structured_output.xgrammar_backend as xb

    def missing(module, **kw):
        raise MissingDependencyError(f"The optional library {module!r} ... pip install {module}")

    monkeypatch.setattr(xb, "require", missing)
    llm = llms("auto")
    manager = StructuredOutputManager(llm.get_tokenizer(), 512, [0], "auto")
    grammar = manager.compile(S(choice=["yes"]))  # served by guidance
    assert type(grammar).__name__ == "GuidanceGrammar"
    only = StructuredOutputManager(llm.get_tokenizer(), 512, [0], "xgrammar")
    with pytest.raises(MissingDependencyError, match="pip install xgrammar"):
        only.compile(S(choice=["yes"]))


def test_bitmask_application_matches_the_bits():
    import torch

    vocab = 70
    logits = torch.zeros(2, vocab)
    mask = torch.zeros(2, bitmask_words(vocab), dtype=torch.int32)
    allowed = [[0, 31, 32, 69], [5]]
    for row, ids in enumerate(allowed):
        for t in ids:
            mask[row, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    apply_token_bitmask(logits, mask)
    for row, ids in enumerate(allowed):
        assert torch.isfinite(logits[row]).nonzero().flatten().tolist() == ids


def _post(url: str, body: dict, stream: bool = False):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            data = resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if not stream:
        return 200, json.loads(data)
    events = [line[6:] for line in data.splitlines() if line.startswith("data: ")]
    return 200, [json.loads(e) for e in events if e != "[DONE]"]


def test_the_server_takes_response_format_and_structured_outputs(server):
    base, _ = server
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "seed": 3,
            "max_tokens": 100}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    status, resp = _post(base + "/v1/chat/completions", {**chat, "response_format": fmt})
    assert status == 200, resp
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    body = {"prompt": [5, 6], "structured_outputs": {"choice": ["left", "right"]}, "n": 3,
            "temperature": 1.0, "seed": 1}  # fmt: skip
    status, resp = _post(base + "/v1/completions", body)
    assert status == 200 and all(c["text"] in ("left", "right") for c in resp["choices"]), resp
    stream = {**chat, "stream": True, "structured_outputs": {"regex": "[xyz]{3}!"}}
    status, events = _post(base + "/v1/chat/completions", stream, stream=True)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert status == 200 and re.fullmatch("[xyz]{3}!", text), text


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
        ({"response_format": {"type": "xml"}}, "response_format type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
        ({"structured_outputs": {"regex": "(bad"}}, "cannot"),
        ({"structured_outputs": {"choice": []}}, "non-empty"),
    ],
)  # fmt: skip
def test_the_server_names_what_is_wrong_with_a_constraint(server, extra, words):
    base, _ = server
    status, resp = _post(base + "/v1/completions", {"prompt": "a", "max_tokens": 3, **extra})
    assert status == 400 and words in resp["error"]["message"], resp
