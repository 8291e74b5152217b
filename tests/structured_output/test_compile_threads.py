"""What runs where for the in-process compiles: llguidance builds one matcher per constraint (on a
compile thread) and each request gets a copy of it; outlines-core's index is read back from its
worker's answer on a compile thread, never on the thread that steps the engine."""

from __future__ import annotations

import re
import threading
import types

import pytest

from llmhal import LLM, SamplingParams
from llmhal.structured_output import StructuredOutputsParams as S
from llmhal.structured_output.manager import StructuredOutputManager
from llmhal.testing.tiny_models import TINY_VOCAB, make_tokenizer
from tests.structured_output.test_compile_processes import masks

SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "string"}}, "required": ["a", "b"]}  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def test_guidance_builds_one_matcher_per_constraint_and_copies_it_per_request(tok):
    llg = pytest.importorskip("llguidance")
    manager = StructuredOutputManager(tok, TINY_VOCAB, [0], "guidance")
    try:
        backend = manager.backend("guidance")
        built = []

        class Matchers:  # llguidance's LLMatcher, counting where matchers are built
            def __call__(self, *args, **kwargs):
                built.append(threading.current_thread())
                return llg.LLMatcher(*args, **kwargs)

            def __getattr__(self, name):  # its static methods (grammar_from_json_schema...)
                return getattr(llg.LLMatcher, name)

        backend._llg = types.SimpleNamespace(**vars(llg))
        backend._llg.LLMatcher = Matchers()
        first, second = (manager.request(S(json=SCHEMA)).result(timeout=60) for _ in range(2))
        assert len(built) == 1 and built[0] is not threading.current_thread()  # a compile thread
        reference = llg.LLMatcher(backend.ll_tokenizer, llg.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": True}), log_level=0)  # fmt: skip
        path = tok.encode('{"a": true, "b": "x"}', add_special_tokens=False)
        expected = masks(type(first)(reference, backend._fill), path)
        # A copy walks as a matcher built for it alone; the other copy stays at the start, and
        # so does the cached prototype, which the next request's copy starts from.
        assert masks(first, path) == expected and first.matcher.is_accepting()
        assert masks(second, []) == expected[:1] and not second.matcher.is_accepting()
        again = manager.request(S(json=SCHEMA)).result(timeout=60)
        assert masks(again, path) == expected
        assert len(built) == 1  # the cache served it: still one matcher built
    finally:
        manager.destroy()


def test_outlines_reads_its_index_back_on_a_compile_thread_not_the_engines(tiny_models):
    """The compile thread that waited for the worker reads the index back too, while the request
    waits in its own state; the engine's step never calls ``Index.from_binary``."""
    oc = pytest.importorskip("outlines_core")
    folder, _ = tiny_models("llama")
    llm = LLM(folder, dtype="float32", max_model_len=128, structured_outputs_config={"backend": "outlines"})  # fmt: skip
    engine = llm.engine
    backend = engine.structured_outputs().backend("outlines")
    readers = []

    def from_binary(raw):
        readers.append(threading.current_thread())
        return oc.Index.from_binary(raw)

    backend._oc = types.SimpleNamespace(**vars(oc))
    backend._oc.Index = types.SimpleNamespace(from_binary=from_binary)
    try:
        plain = engine.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # fmt: skip
        constrained = engine.add_request({"prompt_token_ids": [7]}, SamplingParams(temperature=0, max_tokens=30, structured_outputs=S(regex="(ab|cd){2,4}")))  # fmt: skip
        finished = {}
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        assert len(readers) == 1 and readers[0] is not threading.current_thread()
        assert set(finished) == {plain, constrained}
        assert re.fullmatch("(ab|cd){2,4}", finished[constrained].outputs[0].text)
    finally:
        engine.structured_outputs().destroy()
