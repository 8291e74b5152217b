"""prompt_logprobs in streamed completions and chat: in each choice's first chunk (vLLM's place),
the same as the full answer's and the offline engine's."""

from __future__ import annotations

import pytest

from llmhal.engine.sampling_params import SamplingParams
from llmhal.testing.http_client import post_json


def test_the_first_chunk_carries_the_prompt_logprobs(server):
    base, llm = server
    prompt = [5, 17, 3, 99, 42]
    offline = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1), use_tqdm=False)[0]  # fmt: skip
    body = {"prompt": prompt, "prompt_logprobs": 1, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "n": 2}  # fmt: skip
    status, full = post_json(base + "/v1/completions", body)
    assert status == 200, full
    status, events = post_json(base + "/v1/completions", {**body, "stream": True}, stream=True)
    firsts = {}
    for e in events:
        for c in e["choices"]:
            if c["index"] not in firsts:
                firsts[c["index"]] = c
            else:
                assert "prompt_logprobs" not in c  # the first chunk only
    assert sorted(firsts) == [0, 1]
    # Equal up to float rounding: another batch composition sums in another order.
    want = full["choices"][0]["prompt_logprobs"]
    for c in firsts.values():
        got = c["prompt_logprobs"]
        assert got[0] is None and len(got) == len(want)
        for g, w in zip(got[1:], want[1:], strict=True):
            assert g.keys() == w.keys()
            for tok in g:
                assert g[tok]["decoded_token"] == w[tok]["decoded_token"]
                assert g[tok]["logprob"] == pytest.approx(w[tok]["logprob"], abs=1e-4)
    plp = firsts[0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(prompt)
    for entry, want, t in zip(plp[1:], offline.prompt_logprobs[1:], prompt[1:], strict=True):
        assert entry[str(t)]["logprob"] == pytest.approx(want[t].logprob, abs=1e-4)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "prompt_logprobs": 0, "stream": True}  # fmt: skip
    status, events = post_json(base + "/v1/chat/completions", chat, stream=True)
    ids = llm.chat_prompt([{"role": "user", "content": "hi"}])["prompt_token_ids"]
    assert len(events[0]["prompt_logprobs"]) == len(ids)
    assert all("prompt_logprobs" not in e for e in events[1:])
