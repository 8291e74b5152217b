"""/rerank (Jina/Cohere shape, on /rerank, /v1/rerank, /v2/rerank), /classify's refusal,
truncate_prompt_tokens and the chat form (messages) on the pooling routes, and pooling requests in
/metrics; on the tiny llama, against the offline API on the same engine."""

from __future__ import annotations

import re
import urllib.request

import pytest
import torch

from llmhal.testing.http_client import post_json, running_server

QUERY = "the cat sat"
DOCS = ["a dog ran", "the cat sat on the mat", "stocks fell", "cats sit"]
CHAT = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def served(tiny_models):
    from llmhal import LLM

    folder, _ = tiny_models("llama")
    llm = LLM(folder, dtype="float32", max_model_len=128, max_num_seqs=8)
    with running_server(llm, model_name="tiny") as (base, _):
        yield base, llm


def _embed_ids(llm, ids):
    return torch.tensor(llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.embedding)


def test_rerank_orders_documents_by_the_offline_score(served):
    base, llm = served
    want = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    status, body = post_json(base + "/rerank", {"model": "tiny", "query": QUERY, "documents": DOCS})
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == order
    for r in body["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
        assert r["document"] == {"text": DOCS[r["index"]]}
    tok = llm.get_tokenizer()
    assert body["usage"]["total_tokens"] == sum(len(tok.encode(t)) for t in [QUERY, *DOCS])
    assert body["model"] == "tiny" and body["id"].startswith("rerank-")
    # Cohere's form: documents as {"text"}, the best two, without the texts.
    cohere = {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2, "return_documents": False}  # fmt: skip
    for path in ("/v1/rerank", "/v2/rerank"):
        status, top = post_json(base + path, cohere)
        assert status == 200, top
        assert [r["index"] for r in top["results"]] == order[:2]
        assert all("document" not in r or r["document"] is None for r in top["results"])


def test_rerank_refusals(served):
    base, _ = served
    for body, words in (
        ({"query": QUERY, "documents": []}, "documents"),
        ({"query": QUERY, "documents": [{"image": "x"}]}, "reranks text"),
        ({"documents": DOCS}, "query"),
        ({"query": QUERY, "documents": DOCS, "model": "other"}, "does not exist"),
    ):
        status, resp = post_json(base + "/rerank", body)
        assert status in (400, 404) and words in resp["error"]["message"], (body, resp)


def test_classify_says_why_it_cannot(served):
    base, _ = served
    status, resp = post_json(base + "/classify", {"model": "tiny", "input": "great movie"})
    assert status == 400
    message = resp["error"]["message"]
    assert "LlamaForCausalLM" in message and "classifier head" in message and "rerank" in message


def test_truncate_prompt_tokens_keeps_the_last_tokens(served):
    base, llm = served
    text = "one two three four five six seven"
    ids = llm.get_tokenizer().encode(text)
    want = _embed_ids(llm, ids[-3:])
    status, body = post_json(base + "/v1/embeddings", {"input": text, "truncate_prompt_tokens": 3})
    assert status == 200, body
    torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]), want, atol=1e-6, rtol=0)
    assert body["usage"]["prompt_tokens"] == 3
    status, body = post_json(base + "/pooling", {"input": [ids], "truncate_prompt_tokens": 3})
    torch.testing.assert_close(torch.tensor(body["data"][0]["data"]), want, atol=1e-6, rtol=0)
    status, body = post_json(base + "/v1/embeddings", {"input": [[5] * 200], "truncate_prompt_tokens": -1})  # fmt: skip
    assert status == 200 and body["usage"]["prompt_tokens"] == 128  # the model's context
    status, body = post_json(base + "/score", {"text_1": text, "text_2": DOCS[0], "truncate_prompt_tokens": 3})  # fmt: skip
    doc = _embed_ids(llm, llm.get_tokenizer().encode(DOCS[0])[-3:])
    want_score = float(torch.nn.functional.cosine_similarity(want, doc, dim=0))
    assert body["data"][0]["score"] == pytest.approx(want_score, abs=1e-5)
    status, body = post_json(
        base + "/v1/embeddings", {"input": text, "truncate_prompt_tokens": 129}
    )
    assert status == 400 and "context of 128" in body["error"]["message"]
    status, body = post_json(base + "/v1/embeddings", {"input": text, "truncate_prompt_tokens": -2})
    assert status == 400


def test_embeddings_of_a_chat(served):
    base, llm = served
    text = llm.apply_chat_template(CHAT, False)
    want = _embed_ids(llm, llm.get_tokenizer().encode(text, add_special_tokens=False))
    for path, key in (("/v1/embeddings", "embedding"), ("/pooling", "data")):
        status, body = post_json(base + path, {"messages": CHAT})
        assert status == 200, body
        torch.testing.assert_close(torch.tensor(body["data"][0][key]), want, atol=1e-6, rtol=0)
    status, body = post_json(base + "/v1/embeddings", {"messages": CHAT, "input": "x"})
    assert status == 400 and "one of the two" in body["error"]["message"]


def _metric(base: str, name: str) -> float:
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    total = 0.0
    for line in text.splitlines():
        if re.match(re.escape(name) + r"[{ ]", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_pooling_requests_are_in_the_metrics(served):
    base, llm = served
    ok = 'vllm:request_success_total{engine="0",model_name="tiny",finished_reason="stop"}'
    before = (_metric(base, ok), _metric(base, "vllm:prompt_tokens_total"))
    status, body = post_json(base + "/v1/embeddings", {"input": DOCS})
    assert status == 200
    after = (_metric(base, ok), _metric(base, "vllm:prompt_tokens_total"))
    assert after[0] - before[0] == len(DOCS)
    assert after[1] - before[1] == body["usage"]["prompt_tokens"]
