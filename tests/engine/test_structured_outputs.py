"""Structured outputs through the engine: one conformance suite that every backend (xgrammar,
guidance, outlines, lm-format-enforcer) passes on a tiny random model. Every output is checked by
an independent reference (jsonschema for JSON, re.fullmatch for regexes), with random sampling so
the model's whims explore the grammar; what each backend supports beyond the common part, and what
it refuses (naming it) rather than answer outside the schema; plus the params' and manager's
errors."""

from __future__ import annotations

import functools
import json
import math
import re

import pytest

from llmhal import LLM, SamplingParams
from llmhal.structured_output import StructuredOutputsParams as S
from llmhal.structured_output.backend import apply_token_bitmask, bitmask_words
from llmhal.structured_output.manager import StructuredOutputManager
from llmhal.testing.http_client import post_json
from llmhal.utils.imports import MissingDependencyError

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")
pytest.importorskip("outlines_core")
pytest.importorskip("lmformatenforcer")

# What every backend enforces: outlines and lm-format-enforcer ignore numeric bounds, and
# lm-format-enforcer's integers take exponents, so those are tested per backend below.
COMMON_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "x": {"type": "number"},
        "tag": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "pattern": "^[a-z]{1,5}$"},
        "ids": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3},
    },
    "required": ["ok", "x", "tag", "name", "ids"],
    "additionalProperties": False,
}
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
BACKENDS = ["xgrammar", "guidance", "outlines", "lm-format-enforcer"]
GRAMMAR_BACKENDS = ["xgrammar", "guidance"]  # EBNF grammars; the other two are regex-based


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
    outs = sample(llms(backend), S(json=COMMON_SCHEMA, disable_any_whitespace=True), max_tokens=150)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), COMMON_SCHEMA)
    assert len({o.text for o in outs}) > 1  # sampled, not one forced path


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_object_regex_and_choice(llms, backend):
    llm = llms(backend)
    outs = sample(llm, S(json_object=True, disable_any_whitespace=True), n=6, max_tokens=200)
    done = [o for o in outs if o.finish_reason == "stop"]  # a random model may nest past 200
    assert done and all(isinstance(json.loads(o.text), dict) for o in done), [o.text for o in done]
    for o in sample(llm, S(regex=r"[a-c]{2,4}-\d{3}")):
        assert o.finish_reason == "stop" and re.fullmatch(r"[a-c]{2,4}-\d{3}", o.text), o.text
    choices = ["alpha", "beta gamma", "δέλτα", "a.b|c"]  # multi-byte characters and regex metas
    outs = sample(llm, S(choice=choices), n=8)
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs), [
        o.text for o in outs
    ]


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_grammars(llms, backend):
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    for o in sample(llms(backend), S(grammar=grammar)):
        assert o.finish_reason == "stop" and re.fullmatch(r"\(([0-9x])(,[0-9x])*\)", o.text), o.text


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_numeric_bounds_and_integers(llms, backend):
    for o in sample(llms(backend), S(json=SCHEMA, disable_any_whitespace=True)):
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)


@pytest.mark.parametrize("backend", ["guidance", "outlines"])
def test_formats_and_string_lengths(llms, backend):
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
              "s": {"type": "string", "minLength": 2, "maxLength": 4}, "i": {"type": "integer"}},
              "required": ["d", "s", "i"], "additionalProperties": False}  # fmt: skip
    for o in sample(llms(backend), S(json=schema, disable_any_whitespace=True)):
        assert o.finish_reason == "stop", o.text
        value = json.loads(o.text)
        jsonschema.validate(value, schema)
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", value["d"]), value


@pytest.mark.parametrize(
    "backend, schema, words",
    [
        ("outlines", {"type": "integer", "minimum": 3}, "outlines does not enforce minimum"),
        ("outlines", {"type": "string", "pattern": "a+", "maxLength": 2}, "minLength/maxLength with pattern"),
        ("outlines", {"type": "string", "format": "hostname"}, "format 'hostname'"),
        ("outlines", {"type": "array", "uniqueItems": True}, "uniqueItems"),
        ("lm-format-enforcer", {"type": "integer"}, "does not enforce type 'integer'"),
        ("lm-format-enforcer", {"type": "string", "maxLength": 3}, "maxLength"),
        ("lm-format-enforcer", {"properties": {"a": {"format": "date"}}}, "format 'date'"),
        ("lm-format-enforcer", {"type": "number", "maximum": 3}, "maximum"),
    ],
)  # fmt: skip
def test_what_a_backend_would_not_enforce_is_refused_by_name(llms, backend, schema, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        llms(backend).generate("x", SamplingParams(structured_outputs=S(json=schema)))


@pytest.mark.parametrize("backend", ["outlines", "lm-format-enforcer"])
def test_regex_backends_refuse_grammars_and_bad_regexes(llms, backend):
    with pytest.raises(ValueError, match="not grammars; use the xgrammar or guidance backend"):
        llms(backend).generate("x", SamplingParams(structured_outputs=S(grammar='root ::= "a"')))
    with pytest.raises(ValueError, match=f"{backend} cannot"):
        llms(backend).generate("x", SamplingParams(structured_outputs=S(regex="(unclosed")))


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
    so = S(choice=["ab", "ba"])
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=20, structured_outputs=so)
    (out,) = llm.generate({"prompt_token_ids": [5, 6]}, params)
    tok = llm.get_tokenizer()
    first = out.outputs[0].logprobs[0]
    allowed = {t for t in first if first[t].logprob > -math.inf}
    assert len(first) > len(allowed)  # ruled-out tokens are among the top 20, at -inf
    assert {tok.decode([t]) for t in allowed} <= {"a", "b", "ab", "ba"}
    # The allowed tokens hold the whole mass: it is a distribution over them alone.
    assert math.isclose(sum(math.exp(first[t].logprob) for t in allowed), 1.0, rel_tol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_properties_come_in_the_schemas_order(llms, backend):
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}  # fmt: skip
    for o in sample(llms(backend), S(json=schema, disable_any_whitespace=True), n=3):
        assert o.text.startswith('{"zeta":') and list(json.loads(o.text)) == ["zeta", "alpha"]


def test_a_request_with_nothing_left_to_sample_ends_alone(llms):
    """min_tokens banning the EOS a complete choice needs, or allowed_token_ids the grammar
    forbids: that request ends ("stop"), and the rest of its batch is untouched."""
    llm = llms("xgrammar")
    plain = SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    (alone,) = llm.generate({"prompt_token_ids": [4, 5]}, plain)
    choice = SamplingParams(temperature=1.0, seed=1, max_tokens=8, min_tokens=5, structured_outputs=S(choice=["yes"]))  # fmt: skip
    tok = llm.get_tokenizer()
    other = tok.encode("q")[0]
    blocked = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[other], structured_outputs=S(choice=["yes"]))  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": [4, 5]}, {"prompt_token_ids": [6]}, {"prompt_token_ids": [7]}],
                        [plain, choice, blocked])  # fmt: skip
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert (outs[1].outputs[0].text, outs[1].outputs[0].finish_reason) == ("yes", "stop")
    assert (outs[2].outputs[0].token_ids, outs[2].outputs[0].finish_reason) == ([], "stop")


def test_a_prepared_request_keeps_its_own_params(llms):
    engine = llms("auto").engine
    prep = engine.prepare_request({"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="carries its own SamplingParams"):
        engine.add_request(prep, SamplingParams())


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
        ({"type": "string", "format": "email", "minLength": 3}, ["minLength/maxLength"]),
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


LOOPS = [
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "#/$defs/a -> #/$defs/a"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}},
     "#/$defs/a -> #/$defs/b -> #/$defs/a"),
    ({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}, "# -> #"),
    ({"type": "array", "items": {"anyOf": [{"$ref": "#"}]}, "minItems": 1}, "# -> #"),
]  # fmt: skip


@pytest.mark.parametrize("schema, loop", LOOPS)
def test_a_schema_with_no_finite_instance_is_refused_naming_its_loop(llms, schema, loop):
    """A $ref loop never reaching a value: guidance compiled the bare loop to a grammar complete
    before any token (200, empty text, "stop"), and a required self-reference ran to max_tokens."""
    for backend in ("auto", "guidance"):
        with pytest.raises(ValueError, match="can never be satisfied") as e:
            llms(backend).generate("x", SamplingParams(structured_outputs=S(json=schema)))
        assert loop in str(e.value)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"next": {"$ref": "#"}}},  # optional: a way out
        {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        {"type": "array", "items": {"$ref": "#"}},
        {"$defs": {"a": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/a"},
         "prefixItems": [{"$ref": "#/$defs/a"}] * 3, "minItems": 2},
    ],
)  # fmt: skip
def test_recursive_schemas_with_a_way_out_pass_the_check(schema):
    from llmhal.structured_output.schema_checks import unsatisfiable_ref_loop

    assert unsatisfiable_ref_loop(schema) is None


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
    assert kind.value == "json" and spec == '{"b": 1, "a": 2}'  # the schema's order


def test_backend_names_are_checked_before_the_model_loads(tiny_models):
    folder, _ = tiny_models("llama")
    with pytest.raises(ValueError, match="unknown structured-output backend 'nope'"):
        LLM(folder, structured_outputs_config={"backend": "nope"})
    with pytest.raises(ValueError, match="takes"):
        LLM(folder, structured_outputs_config={"backend": "auto", "enable_in_reasoning": True})
    with pytest.raises(KeyError, match="Reasoning parser 'x' not found"):
        LLM(folder, structured_outputs_config={"reasoning_parser": "x"})


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
    with pytest.raises(ValueError, match="xgrammar backend cannot start.*pip install xgrammar"):
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
    # The CPU path (a lookup per mask byte, added) and the any-device torch path, on random masks,
    # against the bits read one by one; masks as wide as, wider and narrower than the logits;
    # allowed logits keep their values, -inf ones stay -inf.
    from llmhal.structured_output.backend import apply_token_bitmask_torch

    gen = torch.Generator().manual_seed(0)
    # Buffers kept across calls, shapes and batch sizes, as the manager keeps them.
    kept = functools.partial(apply_token_bitmask, scratch={})
    for vocab, words in ((70, 3), (64, 3), (100, 2)):
        mask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
        want = [[t < 32 * words and (int(mask[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)] for r in range(3)]  # fmt: skip
        given = torch.randn(3, vocab, generator=gen)
        given[:, ::7] = float("-inf")
        for apply in (apply_token_bitmask, apply_token_bitmask_torch, kept):
            for rows in (3, 1):
                logits = given[:rows].clone()
                apply(logits, mask[:rows])
                assert torch.equal(logits, given[:rows].masked_fill(~torch.tensor(want[:rows]), float("-inf")))  # fmt: skip


def test_the_server_takes_response_format_and_structured_outputs(server):
    base, _ = server
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "seed": 3,
            "max_tokens": 100}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    status, resp = post_json(
        base + "/v1/chat/completions", {**chat, "response_format": fmt, "n": 4}
    )
    assert status == 200, resp
    # Optional whitespace is allowed here (OpenAI's format has no switch): a random model may
    # spend all 100 tokens on it, but not every time.
    done = [c for c in resp["choices"] if c["finish_reason"] == "stop"]
    assert done, resp
    for choice in done:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    body = {"prompt": [5, 6], "structured_outputs": {"choice": ["left", "right"]}, "n": 3,
            "temperature": 1.0, "seed": 1}  # fmt: skip
    status, resp = post_json(base + "/v1/completions", body)
    assert status == 200 and all(c["text"] in ("left", "right") for c in resp["choices"]), resp
    stream = {**chat, "stream": True, "structured_outputs": {"regex": "[xyz]{3}!"}}
    status, events = post_json(base + "/v1/chat/completions", stream, stream=True)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert status == 200 and re.fullmatch("[xyz]{3}!", text), text


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
        ({"response_format": {"type": "xml"}}, "response_format type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
        ({"structured_outputs": {"regex": "(bad"}}, "no structured-output backend can serve"),
        ({"structured_outputs": {"choice": []}}, "non-empty"),
        ({"structured_outputs": {"json": LOOPS[0][0]}}, "can never be satisfied: its $ref loop #/$defs/a"),
    ],
)  # fmt: skip
def test_the_server_names_what_is_wrong_with_a_constraint(server, extra, words):
    base, _ = server
    status, resp = post_json(base + "/v1/completions", {"prompt": "a", "max_tokens": 3, **extra})
    assert status == 400 and words in resp["error"]["message"], resp


def test_server_logprobs_under_a_constraint_are_strict_json(server):
    import urllib.request

    base, _ = server
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
            "logprobs": True, "top_logprobs": 20, "structured_outputs": {"choice": ["ab", "ba"]}}  # fmt: skip
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:
        raw = resp.read().decode()

    def refuse(name):
        raise AssertionError(f"{name} in the response: not JSON")

    content = json.loads(raw, parse_constant=refuse)["choices"][0]["logprobs"]["content"]
    floors = [t["logprob"] for t in content[0]["top_logprobs"] if t["logprob"] == -9999.0]
    assert floors  # ruled-out tokens are sent at vLLM's floor


def test_vllms_old_guided_fields_get_a_pointer(server):
    base, _ = server
    status, resp = post_json(
        base + "/v1/completions", {"prompt": "a", "guided_json": {"type": "object"}}
    )
    assert status == 400 and "structured_outputs" in resp["error"]["message"]


def test_an_explicit_backend_must_be_installed(tiny_models, monkeypatch):
    import llmhal.utils.imports as imports

    folder, _ = tiny_models("llama")
    real = imports.importlib.import_module

    def no_xgrammar(name, *a):
        if name == "xgrammar":
            raise ImportError("No module named 'xgrammar'")
        return real(name, *a)

    monkeypatch.setattr(imports.importlib, "import_module", no_xgrammar)
    with pytest.raises(MissingDependencyError, match="pip install xgrammar"):
        LLM(folder, structured_outputs_config={"backend": "xgrammar"})
