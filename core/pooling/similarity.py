"""The built-in IO processor ``similarity_ranking``: a tiny retrieval reranker on any model.

Its request ``data`` is ``{"query": str, "documents": [str, ...], "top_n": int (optional)}``; the
query and each document are embedded (the engine's pooler_config, normalized), and the answer ranks
the documents by cosine similarity to the query: ``{"query", "results": [{"index", "document",
"score"}, ...]}``, best first (``top_n`` of them). It is also the worked example of the contract:
see docs/user-guide.md, "Writing an IO processor".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmhal.pooling.io_processor import IOProcessor, IOProcessorResponse
from llmhal.pooling.params import PoolingParams


class SimilarityRanking(IOProcessor[dict, dict]):
    def parse_request(self, request: Any) -> dict:
        data = request.get("data") if isinstance(request, dict) else getattr(request, "data", None)
        if not isinstance(data, dict):
            raise ValueError('similarity_ranking takes data={"query": str, "documents": [str, ...]}')  # fmt: skip
        query, docs, top_n = data.get("query"), data.get("documents"), data.get("top_n")
        if not isinstance(query, str) or not query:
            raise ValueError("similarity_ranking: data.query must be a non-empty string")
        if not isinstance(docs, list) or not docs or not all(isinstance(d, str) and d for d in docs):  # fmt: skip
            raise ValueError("similarity_ranking: data.documents must be a list of non-empty strings")  # fmt: skip
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):  # fmt: skip
            raise ValueError(f"similarity_ranking: data.top_n must be a positive integer, got {top_n!r}")  # fmt: skip
        return {"query": query, "documents": docs, "top_n": top_n or len(docs)}

    def pre_process(self, prompt: dict, request_id: str | None = None, **kwargs: Any) -> list[str]:
        return [prompt["query"], *prompt["documents"]]

    def validate_or_generate_params(self, params: PoolingParams | None = None) -> PoolingParams:
        return PoolingParams(task="embed", normalize=True)

    def post_process(self, model_output: Sequence[Any], request_id: str | None = None, **kwargs: Any) -> dict:  # fmt: skip
        import torch

        query, *docs = model_output
        scores = [
            float(torch.nn.functional.cosine_similarity(query.outputs.data, d.outputs.data, dim=0))
            for d in docs
        ]
        texts = [d.prompt for d in docs]
        order = sorted(range(len(docs)), key=lambda i: -scores[i])
        top_n = (kwargs.get("request") or {}).get("top_n") or len(docs)
        return {
            "query": query.prompt,
            "results": [
                {"index": i, "document": texts[i], "score": scores[i]} for i in order[:top_n]
            ],  # fmt: skip
        }

    def output_to_response(self, plugin_output: dict) -> IOProcessorResponse:
        return IOProcessorResponse(data=plugin_output)
