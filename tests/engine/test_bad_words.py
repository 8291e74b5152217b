"""SamplingParams(bad_words=...): the banned words never come out, and only what they ban changes."""

from __future__ import annotations

import pytest

from llmhal import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_models):
    folder, _ = tiny_models("llama")
    return LLM(folder, dtype="float32", max_model_len=128)


def greedy(llm: LLM, prompt: list[int], **kw):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kw)
    return llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_a_banned_word_changes_the_output_from_where_it_appeared(llm):
    prompt = [5, 9, 14]
    base = greedy(llm, prompt)
    tok = llm.get_tokenizer()
    # A word the model says: the text of output tokens 3..4 (a two-token sequence at least).
    word = tok.decode(base.token_ids[3:5])
    out = greedy(llm, prompt, bad_words=[word])
    for seq in llm.engine.bad_words_token_ids([word]):
        assert not contains(out.token_ids, seq), (word, seq, out.token_ids)
    # Everything before the first place a banned sequence could complete is unchanged.
    seqs = llm.engine.bad_words_token_ids([word])
    first = min(i + len(s) - 1 for s in seqs for i in range(len(base.token_ids)) if base.token_ids[i : i + len(s)] == s)  # fmt: skip
    assert out.token_ids[:first] == base.token_ids[:first]
    assert out.token_ids[first] != base.token_ids[first]


def clean_token(llm: LLM, ids: list[int]) -> int:
    """The first of ``ids`` whose text tokenizes back to it alone (not a piece of a character)."""
    tok = llm.get_tokenizer()
    return next(t for t in ids if tok.encode(tok.decode([t]), add_special_tokens=False) == [t])


def test_one_token_words_are_banned_everywhere(llm):
    prompt = [7, 3]
    base = greedy(llm, prompt)
    banned = clean_token(llm, base.token_ids)
    word = llm.get_tokenizer().decode([banned])
    out = greedy(llm, prompt, bad_words=[word])
    assert [banned] in llm.engine.bad_words_token_ids([word])
    assert banned not in out.token_ids


def test_bad_words_are_checked(llm):
    for bad in ("word", [""], ["  "], [3]):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)
    assert SamplingParams(bad_words=[]).bad_words is None


def test_the_server_takes_bad_words(server):
    import json
    import urllib.request

    base, llm = server
    prompt = [5, 9, 14]
    banned = clean_token(llm, greedy(llm, prompt).token_ids)
    word = llm.get_tokenizer().decode([banned])
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "bad_words": [word], "logprobs": 0}  # fmt: skip
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        token_ids = json.load(r)["choices"][0]["logprobs"]["token_ids"]
    assert token_ids == greedy(llm, prompt, bad_words=[word]).token_ids
    assert banned not in token_ids


class _Tok:
    """A tokenizer of fixed answers, to pin the rule for the with-a-space form."""

    def __init__(self, table):
        self.table = table

    def encode(self, text, add_special_tokens=False):
        return self.table[text]


@pytest.mark.parametrize(
    "table, expected",
    [
        ({"nasty": [1, 2], " nasty": [3]}, [[1, 2]]),  # another length: only as written
        ({"nasty": [1, 2], " nasty": [3, 2]}, [[1, 2], [3, 2]]),  # same length, another start
        ({"nasty": [1, 2], " nasty": [1, 2]}, [[1, 2]]),  # the same: once
        ({"nasty": [1, 2], " nasty": [1, 5]}, [[1, 2]]),  # same first token: not added (vLLM)
    ],
)
def test_the_spaced_form_follows_vllms_rule(table, expected):
    from types import SimpleNamespace

    from llmhal.engine.llm_engine import LLMEngine

    stub = SimpleNamespace(tokenizer=_Tok(table))
    assert LLMEngine.bad_words_token_ids(stub, ["nasty"]) == expected


def test_too_many_bad_words_are_refused_before_any_work(llm):
    words = [f"w{i} x{i} y{i}" for i in range(400)]
    with pytest.raises(ValueError, match="more than 1024 tokens"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(bad_words=words))
    assert not llm.engine.has_unfinished_requests()
