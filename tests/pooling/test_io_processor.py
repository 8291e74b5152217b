"""IO processors: the built-in similarity_ranking, and one from a throwaway distribution, through
LLM.encode({"data": ...}) (the server's /pooling with data is in test_server.py)."""

from __future__ import annotations

import pytest

from llmhal.pooling.io_processor import load_io_processor
from llmhal.testing.distributions import FakeDistribution, build_distributions
from llmhal.testing.isolation import fresh_plugin_state

DOCS = ["the cat sat on the mat", "stock prices fell", "a cat on a mat"]


def test_similarity_ranking_offline(tiny_llm):
    llm, _ = tiny_llm
    llm.engine.pooler_config = None  # defaults: LAST, normalized
    llm.io_processor = load_io_processor(llm.engine.config, "similarity_ranking")
    try:
        answer = llm.encode({"data": {"query": "cat on mat", "documents": DOCS, "top_n": 2}})
    finally:
        llm.io_processor = None
    want = [o.outputs.score for o in llm.score("cat on mat", DOCS, use_tqdm=False)]
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in answer["results"]] == best
    assert [r["document"] for r in answer["results"]] == [DOCS[i] for i in best]
    assert [r["score"] for r in answer["results"]] == pytest.approx([want[i] for i in best], abs=1e-6)  # fmt: skip
    with pytest.raises(
        ValueError, match="has none; start it with LLM\\(io_processor_plugin=NAME\\)"
    ):
        llm.encode({"data": {"query": "q", "documents": DOCS}})


PROC = """
from llmhal.pooling.io_processor import IOProcessor, IOProcessorResponse


def plugin():
    return "lengthproc:TokenCounts"


class TokenCounts(IOProcessor):
    # Answers each text's prompt length and vector size: an out-of-tree processor's whole life.
    def parse_request(self, request):
        return list(request["data"]["texts"])

    def pre_process(self, prompt, request_id=None, **kwargs):
        return prompt

    def post_process(self, model_output, request_id=None, **kwargs):
        return [[len(o.prompt_token_ids), int(o.outputs.data.shape[-1])] for o in model_output]

    def output_to_response(self, plugin_output):
        return IOProcessorResponse(data=plugin_output)
"""


def test_out_of_tree_processor_from_a_distribution(tiny_llm, tmp_path, monkeypatch):
    llm, hf = tiny_llm
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    dist = FakeDistribution(
        "token-counts",
        entry_points={"vllm.io_processor_plugins": {"token_counts": "lengthproc:plugin"}},
        modules={"lengthproc.py": PROC},
    )
    root = build_distributions(tmp_path / "dists", dist)
    with fresh_plugin_state(root):
        proc = load_io_processor(llm.engine.config, "token_counts")
        with pytest.raises(ValueError, match="'nope' is not installed .*available: similarity_ranking, token_counts"):  # fmt: skip
            load_io_processor(llm.engine.config, "nope")
    with fresh_plugin_state(root):
        monkeypatch.setenv("VLLM_PLUGINS", "")  # the allow-list is a security boundary
        with pytest.raises(ValueError, match="not allowed by VLLM_PLUGINS"):
            load_io_processor(llm.engine.config, "token_counts")
    llm.io_processor = proc
    try:
        answer = llm.encode({"data": {"texts": ["a", "the cat sat"]}})
    finally:
        llm.io_processor = None
    tok = llm.get_tokenizer()
    assert answer == [[len(tok.encode(t)), hf.config.hidden_size] for t in ("a", "the cat sat")]
