"""Sequence classifiers (``*ForSequenceClassification``): LLM.classify and POST /classify against
transformers' own classifier on the same tiny random checkpoint (fp32 probabilities), and the
refusals: generating with a classifier, classifying with a causal LM."""

from __future__ import annotations

import pytest
import torch

from llmhal.testing.http_client import post_json, running_server
from llmhal.testing.tiny_models import make_tokenizer, tiny_config

TEXTS = ["The quick brown fox", "Paris is the capital of France.", "0 1 2"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _classifier(folder, arch: str):
    import transformers

    torch.manual_seed(0)
    config = tiny_config(arch, num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()}, pad_token_id=0)  # fmt: skip
    cls = {"llama": transformers.LlamaForSequenceClassification, "qwen3": transformers.Qwen3ForSequenceClassification}[arch]  # fmt: skip
    hf = cls(config).eval()
    hf.save_pretrained(folder)
    tok = make_tokenizer()
    tok.save_pretrained(folder)
    return hf, tok


def _hf_probs(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().softmax(-1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_probabilities_equal_transformers(tmp_path, arch):
    from llmhal import LLM

    hf, tok = _classifier(tmp_path, arch)
    llm = LLM(
        str(tmp_path), dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16
    )
    outs = llm.classify(TEXTS, use_tqdm=False)  # chunked prompts, batched together
    for text, out in zip(TEXTS, outs, strict=True):
        ids = tok.encode(text)
        assert out.prompt_token_ids == ids and out.outputs.num_classes == 3
        torch.testing.assert_close(torch.tensor(out.outputs.probs), _hf_probs(hf, ids), atol=1e-5, rtol=0)  # fmt: skip
    with pytest.raises(ValueError, match="is a classifier: it does not generate"):
        llm.generate("hi", use_tqdm=False)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from llmhal import LLM

    folder = tmp_path_factory.mktemp("classifier")
    hf, tok = _classifier(folder, "llama")
    llm = LLM(str(folder), dtype="float32", max_model_len=64)
    with running_server(llm, model_name="clf") as (base, _):
        yield base, hf, tok


def test_the_classify_route(served):
    base, hf, tok = served
    status, body = post_json(base + "/classify", {"model": "clf", "input": TEXTS})
    assert status == 200, body
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
    for text, d in zip(TEXTS, body["data"], strict=True):
        want = _hf_probs(hf, tok.encode(text))
        torch.testing.assert_close(torch.tensor(d["probs"]), want, atol=1e-5, rtol=0)
        assert d["label"] == LABELS[int(want.argmax())] and d["num_classes"] == 3
    assert body["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in TEXTS)
    ids = tok.encode(TEXTS[1])
    status, cut = post_json(base + "/classify", {"input": TEXTS[1], "truncate_prompt_tokens": 3})
    torch.testing.assert_close(torch.tensor(cut["data"][0]["probs"]), _hf_probs(hf, ids[-3:]), atol=1e-5, rtol=0)  # fmt: skip
    status, resp = post_json(base + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 400 and "is a classifier" in resp["error"]["message"]
