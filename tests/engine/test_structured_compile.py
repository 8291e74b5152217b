"""Structured-output constraints compile off the engine's path: on the manager's threads, cached by
(backend, spec), while the rest of the batch keeps decoding; a constraint that fails to compile
fails only its own request."""

from __future__ import annotations

import json
import re
import statistics
import time

import pytest

from llmhal import LLM, SamplingParams
from llmhal.engine.request import RequestStatus
from llmhal.structured_output import StructuredOutputsParams as S

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")

# A constraint per backend that takes a while to compile on the tiny model's vocabulary (times
# on an idle core; the compile runs below the engine's priority, so longer on a busy machine).
_EMAILS = {"type": "object", "properties": {f"f{i}": {"type": "string", "format": "email"} for i in range(4)}, "required": [f"f{i}" for i in range(4)]}  # fmt: skip
SLOW = {
    # xgrammar 1.3 s; it releases the GIL while it compiles, on the compile thread.
    "xgrammar": {"json": {
        "type": "object",
        "properties": {f"f{i}": {"type": "string", "format": "email"} for i in range(100)}
        | {f"g{i}": {"type": "array", "items": {"type": "object", "properties": {
            "a": {"type": "string", "format": "uri"}, "b": {"type": "number"}}}} for i in range(100)},
        "required": [f"f{i}" for i in range(3)],
    }},
    # llguidance: a 0.45 s matcher (the request gets a copy); it gives the GIL back meanwhile.
    "guidance": {"json": {"type": "object", "properties": {f"f{i}": {"type": "string", "format": "email"} for i in range(2000)}, "required": ["f0", "f1", "f2"]}},
    # outlines-core: a 0.6 s index (in a compile process).
    "outlines": {"json": _EMAILS},
    # lm-format-enforcer's interegular: a 0.5 s automaton (in a compile process).
    "lm-format-enforcer": {"regex": r"([a-z]{1,30}@[a-z]{1,20}\.(com|org)){1,25}"},
}  # fmt: skip


@pytest.fixture(scope="module")
def xgrammar_llm(tiny_models):
    folder, _ = tiny_models("llama")
    return LLM(folder, dtype="float32", max_model_len=512, structured_outputs_config={"backend": "xgrammar"})  # fmt: skip


# Timed (paces of a stream in 50 ms slices): in the slow tier, where a busy CI machine's noise
# cannot fail the fast one; `llmhal bench structured` reports the same effect as numbers.
@pytest.mark.slow
@pytest.mark.parametrize("backend", list(SLOW))
def test_a_slow_compile_does_not_slow_a_running_stream(backend, tiny_models):
    pytest.importorskip({"outlines": "outlines_core", "lm-format-enforcer": "lmformatenforcer"}.get(backend, "xgrammar"))  # fmt: skip
    folder, _ = tiny_models("llama")
    llm = LLM(folder, dtype="float32", max_model_len=512, structured_outputs_config={"backend": backend})  # fmt: skip
    # The backend's one-time start (its vocabulary tables) is not a compile: done first.
    llm.generate("x", SamplingParams(max_tokens=2, structured_outputs=S(choice=["ab", "cd"])))
    engine = llm.engine
    plain = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    streams = [engine.add_request({"prompt_token_ids": [5, 6]}, plain)]

    finished = {}

    def steps(until) -> list[float]:
        """When each step ended; a stream that ends (500 tokens) is followed by another, so one
        is always decoding."""
        ends = []
        while not until():
            outs = engine.step()
            ends.append(time.perf_counter())
            finished.update((o.request_id, o) for o in outs if o.finished)
            if streams[-1] in finished:
                streams.append(engine.add_request({"prompt_token_ids": [5, 6]}, plain))
        return ends

    try:
        measure(engine, steps, finished, SLOW[backend])
    finally:
        for rid in list(engine._requests):
            engine.abort_request(rid)
        engine.structured_outputs().destroy()


BIN = 0.05  # seconds


def steps_per_bin(start: float, end: float, ends: list[float]) -> list[int]:
    """How many steps ended in each BIN-long slice of [start, end) (a stall leaves zeros)."""
    counts = [0] * int((end - start) / BIN)
    for t in ends:
        if start <= t and (i := int((t - start) / BIN)) < len(counts):
            counts[i] += 1
    return counts


def paced(steps, seconds: float) -> list[int]:
    """The stream's steps per BIN over the next ``seconds``."""
    start = time.perf_counter()
    return steps_per_bin(start, start + seconds, steps(lambda: time.perf_counter() > start + seconds))  # fmt: skip


def measure(engine, steps, finished, constraint) -> None:
    for _ in range(5):  # past the first steps' one-time costs
        engine.step()
    before = paced(steps, 1.0)
    t = time.perf_counter()
    slow = engine.add_request({"prompt_token_ids": [7]}, SamplingParams(temperature=1.0, seed=0, max_tokens=200, structured_outputs=S(**constraint)))  # fmt: skip
    assert time.perf_counter() - t < 0.5  # add_request does not wait for the compile
    req = engine._requests[slow]
    assert req.status is RequestStatus.WAITING_FOR_FSM
    ends = steps(lambda: req.status is not RequestStatus.WAITING_FOR_FSM)
    # Up to the step that admitted the request (its prefill and first mask: the batch's work).
    during = steps_per_bin(t, ends[-2], ends[:-1])
    if len(during) < 4:  # a fast host (or a warm compiler cache): nothing stalled to measure
        pytest.skip(f"the compile took {len(during) * BIN:.2f} s: too quick to measure a stall")
    steps(lambda: slow in finished)
    # The stream alone again: with the pace before, the baseline (the shared machine's load
    # drifts over a compile of several seconds).
    after = paced(steps, 1.0)
    # The stream's pace in 50 ms slices, median over the slices: a compile holding the GIL
    # stalls most slices (lm-format-enforcer on the compile thread: a few steps of a second
    # each, so the median step time saw nothing), while the shared machine's own bursts touch
    # a few slices only.
    baseline = statistics.median(before + after)
    ratio = baseline / max(statistics.median(during), 0.5)
    assert ratio <= 1.5, (ratio, statistics.median(before), statistics.median(during), statistics.median(after), len(during))  # fmt: skip
    out = finished[slow].outputs[0]
    if "regex" in constraint:
        assert out.finish_reason != "stop" or re.fullmatch(constraint["regex"], out.text), out.text
        return
    if out.finish_reason == "stop":  # a random model may write long strings
        jsonschema.validate(json.loads(out.text), constraint["json"])
    assert out.text.startswith("{")


def test_a_constraint_that_fails_to_compile_fails_alone(xgrammar_llm):
    engine = xgrammar_llm.engine
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (alone,) = xgrammar_llm.generate({"prompt_token_ids": [4, 5]}, plain)
    ok = engine.add_request({"prompt_token_ids": [4, 5]}, plain)
    # Refused on the compile thread: the request ends alone ("abort"), or, when the compile
    # thread was quicker than add_request, add_request refuses it.
    try:
        bad = engine.add_request({"prompt_token_ids": [6]}, SamplingParams(structured_outputs=S(regex="(unclosed")))  # fmt: skip
    except ValueError as e:
        assert "xgrammar cannot compile" in str(e)
        bad = None
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    if bad is not None:
        assert (
            outs[bad].outputs[0].finish_reason == "abort" and outs[bad].outputs[0].token_ids == []
        )
    assert outs[ok].outputs[0].token_ids == alone.outputs[0].token_ids
    # Offline, the same constraint is an error before anything runs.
    with pytest.raises(ValueError, match="xgrammar cannot compile this regex constraint"):
        xgrammar_llm.generate("x", SamplingParams(structured_outputs=S(regex="(unclosed")))


def test_compiled_constraints_are_cached_by_backend_and_spec(tiny_models):
    folder, _ = tiny_models("llama")
    llm = LLM(folder, dtype="float32", max_model_len=128)
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=20, structured_outputs=S(json=schema, disable_any_whitespace=True)) for s in range(4)]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": [3, 4]}] * 4, params)
    manager = llm.engine.structured_outputs()
    assert manager.compiles == 1  # four requests, one compile
    assert all(json.loads(o.outputs[0].text) in ({"a": True}, {"a": False}) for o in outs)
    llm.generate(
        "x", SamplingParams(max_tokens=5, structured_outputs=S(json=schema))
    )  # whitespace: another
    assert manager.compiles == 2
    for _ in range(2):  # a failure is remembered too
        with pytest.raises(ValueError, match="no structured-output backend can serve"):
            llm.generate("x", SamplingParams(structured_outputs=S(regex="(unclosed")))
    assert manager.compiles == 3
    # Each request still walks its own grammar over the shared compiled constraint.
    a, b = manager.compile(S(choice=["yes", "no"])), manager.compile(S(choice=["yes", "no"]))
    assert a is not b and manager.compiles == 4


def test_compiling_on_the_callers_thread(tiny_models):
    """async_compile=False (vLLM's choice for its external_launcher executor): done at once."""
    from llmhal.structured_output.manager import StructuredOutputManager

    folder, _ = tiny_models("llama")
    llm = LLM(folder, dtype="float32", max_model_len=128)
    manager = StructuredOutputManager(llm.get_tokenizer(), 512, [0], "xgrammar", async_compile=False)  # fmt: skip
    pending = manager.request(S(regex="[ab]{3}"))
    assert pending.ready() and manager._pool is None
    bad = manager.request(S(regex="(unclosed"))
    assert bad.ready() and isinstance(bad.error(), ValueError)


def test_the_regex_backends_read_each_tokens_own_bytes(tiny_models):
    """outlines and lm-format-enforcer take a vocabulary of token texts: on the byte-level BPE
    tokenizer every regular token's bytes are what the tokenizer decodes it to (tokens holding
    part of a character too), and special tokens stand for no text."""
    from llmhal.structured_output.vocab import token_bytes

    folder, _ = tiny_models("llama")
    tok = LLM(folder, dtype="float32", max_model_len=64).get_tokenizer()
    got = token_bytes(tok, len(tok) + 7)  # padding rows past the tokenizer: none
    special = set(tok.all_special_ids) | {
        i for i, t in tok.added_tokens_decoder.items() if t.special
    }
    assert set(got) == set(range(len(tok))) - special
    for i, raw in got.items():
        text = tok.decode([i])
        if "\ufffd" not in text:
            assert raw == text.encode(), (i, raw, text)
        else:  # part of a character: complete with the next byte tokens it decodes as bytes
            assert raw.decode("utf-8", errors="replace") == text
