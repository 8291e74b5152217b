"""outlines-core and lm-format-enforcer compile in worker processes (started on first use, at
most two, reused): what comes back equals what the library builds in-process, a constraint the
library refuses fails alone with its message, and a worker that dies fails only the request it
was serving."""

from __future__ import annotations

import json
import re

import pytest
import torch

from llmhal.structured_output import StructuredOutputsParams as S
from llmhal.structured_output.backend import bitmask_words
from llmhal.structured_output.manager import StructuredOutputManager
from llmhal.structured_output.params import StructuredOutputOptions as K
from llmhal.testing.tiny_models import TINY_VOCAB, make_tokenizer

oc = pytest.importorskip("outlines_core")
lmfe = pytest.importorskip("lmformatenforcer")
interegular = pytest.importorskip("interegular")

EMAIL = {"type": "object", "properties": {"a": {"type": "string", "format": "email"}}, "required": ["a"]}  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture
def manager(tok):
    made = []

    def make(backend):
        m = StructuredOutputManager(tok, TINY_VOCAB, [0], backend)
        made.append(m)
        return m

    yield make
    for m in made:
        m.destroy()


def masks(grammar, tokens) -> list[list[int]]:
    """The grammar's bitmask before each of ``tokens`` and after the last."""
    out = []
    row = torch.empty(1, bitmask_words(TINY_VOCAB), dtype=torch.int32)
    for t in [*tokens, None]:
        grammar.fill_bitmask(row, 0)
        out.append(row[0].tolist())
        if t is not None:
            assert grammar.accept_tokens("r", [t])
    return out


def test_an_outlines_index_from_a_worker_equals_the_librarys_own(manager, tok):
    m = manager("outlines")
    grammar = m.request(S(json=EMAIL)).result(timeout=120)
    assert m.processes.started == 1
    backend = m.backend("outlines")
    regex = oc.json_schema.build_regex_from_schema(json.dumps(EMAIL))
    own = oc.Index(regex, backend.vocabulary)  # in this process, as the library builds it
    text = '{"a": "jo@x.org"}'
    ids = tok.encode(text, add_special_tokens=False)
    assert masks(grammar, ids) == masks(backend.grammar(own), ids)
    assert grammar.accept_tokens("r", [0]) and grammar.is_terminated()


def test_lm_format_enforcer_automata_from_a_worker_equal_interegulars(manager, tok):
    from llmhal.structured_output.compile_worker import fsm_from_json, fsm_to_json, regex_fsm

    pattern = r"([a-z]{1,3}@[a-z]{1,2}\.(com|org)){1,2}|x+\d?"
    own = interegular.parse_pattern(pattern).to_fsm()
    back = fsm_from_json(json.loads(json.dumps(fsm_to_json(regex_fsm(pattern)))))
    assert (back.initial, back.finals, back.states, back.map) == (own.initial, own.finals, own.states, own.map)  # fmt: skip
    assert dict(back.alphabet.items()) == dict(own.alphabet.items())
    # Through the manager: a worker builds it, and the request's masks equal the library's
    # own RegexParser's (which builds the same automaton here).
    m = manager("lm-format-enforcer")
    grammar = m.request(S(regex=pattern)).result(timeout=120)
    assert m.processes.started == 1
    backend = m.backend("lm-format-enforcer")
    own_grammar = backend.grammar((lambda: lmfe.RegexParser(pattern), False))
    ids = tok.encode("ab@c.orgx", add_special_tokens=False)[:4]
    assert masks(grammar, ids) == masks(own_grammar, ids)


def test_a_schemas_patterns_are_built_before_decoding(manager, tok):
    """lm-format-enforcer's JSON parser would build a pattern's automaton on the engine's thread
    when the string begins; the worker builds it with the constraint."""
    pattern = "^[a-c]{2}-[0-9]{3}$"
    schema = {"type": "object", "properties": {"id": {"type": "string", "pattern": pattern}, "pattern": {"type": "string", "pattern": "q+"}}, "required": ["id"]}  # fmt: skip
    cache = lmfe.JsonSchemaParser._Context.regex_parser_cache
    for key in ("[a-c]{2}-[0-9]{3}", "q+"):
        cache.pop(key, None)
    m = manager("lm-format-enforcer")
    grammar = m.request(S(json=schema)).result(timeout=120)
    assert {"[a-c]{2}-[0-9]{3}", "q+"} <= set(cache)  # a property named "pattern" too
    text = '{"id": "ab-123"}'
    for t in tok.encode(text, add_special_tokens=False):
        assert grammar.accept_tokens("r", [t])
    assert grammar.accept_tokens("r", [0]) and grammar.is_terminated()


def test_workers_are_bounded_and_reused(manager):
    m = manager("outlines")
    pending = [m.request(S(regex=f"[ab]{{{n}}}c")) for n in range(1, 7)]
    for p in pending:
        p.result(timeout=120)
    assert 1 <= m.processes.started <= 2
    started = m.processes.started
    m.request(S(regex="zz+")).result(timeout=120)
    assert m.processes.started == started  # an idle worker took it


def test_a_refused_constraint_fails_alone_with_the_librarys_reason(manager):
    m = manager("lm-format-enforcer")
    with pytest.raises(ValueError, match=re.escape("lm-format-enforcer cannot read the regular expression '(unclosed'")):  # fmt: skip
        m.request(S(regex="(unclosed")).result(timeout=120)
    assert m.request(S(regex="[ab]+")).result(timeout=120) is not None
    assert m.processes.started == 1  # the worker that refused it served the next one


def test_a_worker_that_dies_fails_only_its_request(manager):
    m = manager("outlines")
    m.request(S(regex="a+")).result(timeout=120)
    for p in list(m.processes._all):
        p.proc.kill()  # as an out-of-memory kill would
    with pytest.raises(ValueError, match="compile process ended"):
        m.request(S(regex="b+")).result(timeout=120)
    assert m.request(S(regex="c+")).result(timeout=120) is not None  # a new worker
    assert m.processes.started == 2


def test_compiling_on_the_callers_thread_starts_no_process(tok):
    m = StructuredOutputManager(tok, TINY_VOCAB, [0], "outlines", async_compile=False)
    try:
        assert m.processes is None
        assert m.compile(S(regex="[ab]{2}")) is not None
        assert m.backend("outlines").compile(K.REGEX, "x+") is not None
    finally:
        m.destroy()


def test_an_external_launcher_engine_compiles_on_the_callers_thread(tiny_models):
    """vLLM turns the compile pool off for external_launcher (each rank compiles in step)."""
    from llmhal import LLM

    folder, _ = tiny_models("llama")
    llm = LLM(folder, dtype="float32", max_model_len=64)
    llm.engine.config.parallel.distributed_executor_backend = "external_launcher"
    manager = llm.engine.structured_outputs()
    assert manager.async_compile is False and manager.processes is None
    pending = manager.request(S(regex="[ab]{2}"))
    assert pending.ready() and manager._pool is None
