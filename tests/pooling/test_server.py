"""POST /v1/embeddings (through the official openai SDK, answers validated with its types),
/pooling and /score on a tiny model, against the offline API on the same engine."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from llmhal.testing.http_client import post_json, running_server

openai = pytest.importorskip("openai")
from openai.types import CreateEmbeddingResponse  # noqa: E402

TEXTS = ["a", "the cat sat", "the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def served(tiny_models):
    from llmhal import LLM

    folder, _ = tiny_models("llama", matryoshka_dimensions=[8, 16])
    llm = LLM(folder, dtype="float32", max_model_len=128, max_num_seqs=8, io_processor_plugin="similarity_ranking")  # fmt: skip
    with running_server(llm, model_name="tiny") as (base, _):
        yield base, llm


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def test_embeddings_with_the_sdk(client, served):
    _, llm = served
    offline = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    # The SDK asks for base64 by default (and decodes it); float is asked for explicitly.
    for fmt in (openai.NOT_GIVEN, "float"):
        resp = client.embeddings.create(model="tiny", input=TEXTS, encoding_format=fmt)
        CreateEmbeddingResponse.model_validate(resp.model_dump())
        assert [d.index for d in resp.data] == [0, 1, 2]
        for d, want in zip(resp.data, offline, strict=True):
            assert d.embedding == pytest.approx(want, abs=1e-6)
        assert resp.usage.prompt_tokens == sum(len(llm.get_tokenizer().encode(t)) for t in TEXTS)
    one = client.embeddings.create(model="tiny", input=TEXTS[1], dimensions=8)
    assert len(one.data[0].embedding) == 8
    assert float(np.linalg.norm(one.data[0].embedding)) == pytest.approx(1.0, abs=1e-5)
    ids = llm.get_tokenizer().encode(TEXTS[2])
    by_ids = client.embeddings.create(model="tiny", input=[ids])
    assert by_ids.data[0].embedding == pytest.approx(offline[2], abs=1e-6)


def test_embedding_errors_are_the_sdks(client):
    with pytest.raises(openai.BadRequestError, match="use one of \\[8, 16\\]"):
        client.embeddings.create(model="tiny", input="x", dimensions=12)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")
    with pytest.raises(openai.BadRequestError, match="context is 128 tokens"):
        client.embeddings.create(model="tiny", input=[[5] * 129])


def test_pooling_route(served):
    base, llm = served
    status, body = post_json(base + "/pooling", {"input": TEXTS[1], "task": "token_embed"})
    assert status == 200, body
    want = llm.encode(TEXTS[1], pooling_task="token_embed", use_tqdm=False)[0].outputs.data
    assert body["object"] == "list" and body["data"][0]["object"] == "pooling"
    torch.testing.assert_close(torch.tensor(body["data"][0]["data"]), want, atol=1e-6, rtol=0)
    status, body = post_json(base + "/pooling", {"input": [TEXTS[0]], "encoding_format": "base64"})
    raw = np.frombuffer(base64.b64decode(body["data"][0]["data"]), dtype="<f4")
    want = llm.embed(TEXTS[0], use_tqdm=False)[0].outputs.embedding
    assert raw.tolist() == pytest.approx(want, abs=1e-6)
    status, body = post_json(base + "/pooling", {"input": "x", "dimensions": 8})
    assert status == 400 and "/v1/embeddings" in body["error"]["message"]


def test_routes_are_in_the_openapi_document(served):
    import json
    import urllib.request

    with urllib.request.urlopen(served[0] + "/openapi.json") as r:
        paths = json.load(r)["paths"]
    for path in ("/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify", "/v1/responses"):  # fmt: skip
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert "properties" in body and "400" in paths[path]["post"]["responses"], path


def test_score_route(served):
    base, llm = served
    status, body = post_json(base + "/score", {"model": "tiny", "text_1": TEXTS[0], "text_2": TEXTS})  # fmt: skip
    assert status == 200, body
    want = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS, use_tqdm=False)]
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-6)
    status, body = post_json(base + "/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS})
    assert status == 400 and "got 2 and 3" in body["error"]["message"]


def test_pooling_with_data_goes_through_the_io_processor(served):
    base, llm = served
    docs = ["the cat sat", "stock prices fell", "a cat"]
    body = {"data": {"query": "cat", "documents": docs}}
    status, resp = post_json(base + "/pooling", body, headers={"X-Request-Id": "r1"})
    assert status == 200, resp
    assert resp["request_id"] == "r1" and isinstance(resp["created_at"], int)
    want = [o.outputs.score for o in llm.score("cat", docs, use_tqdm=False)]
    got = {r["index"]: r["score"] for r in resp["data"]["results"]}
    assert got == pytest.approx(dict(enumerate(want)), abs=1e-6)
    assert [r["score"] for r in resp["data"]["results"]] == sorted(want, reverse=True)
    status, resp = post_json(base + "/pooling", {"data": {"query": "cat"}})
    assert status == 400 and "data.documents" in resp["error"]["message"]
