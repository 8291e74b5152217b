"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) through our Llama class against HF.

The HF reference is transformers' ``LlamaForCausalLM`` holding weights dequantized by the ``gguf``
package (independent of llmhal's own dequantization). Our model runs the exact GGUF path
(``LLMHAL_GGUF_KERNEL=dequant``), so the two compute with the same weights in float32.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_reference():
    import gguf
    import numpy as np
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmhal.default_model import default_model_path
    from llmhal.model_loader.gguf_loader import GGUFFile, unpermute_rows

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    g = GGUFFile(path)
    cfg = g.config_dict()
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    state = {}
    for name, info in g.tensors.items():
        hf_name = g.hf_name(name)
        raw = g.raw(name)
        if raw.dtype == torch.uint8:
            qtype = gguf.GGMLQuantizationType(info.type_id)
            w = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw.numpy(), qtype)))
            w = w.float().reshape(info.shape)
        else:
            w = raw.float()
        if hf_name.split(".")[-2] in heads:
            w = unpermute_rows(w, heads[hf_name.split(".")[-2]])
        state[hf_name] = w
    # transformers' own config class over the file's fields (llmhal's config carries only what the
    # engine reads; see tests/model_loader/test_hf_config.py).
    hf = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert unexpected == [] and missing in ([], ["lm_head.weight"])
    hf.tie_weights()
    tok = g.tokenizer()
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompts = [
        tok.encode(chat, add_special_tokens=False),
        tok.encode("The three primary colors are", add_special_tokens=False),
    ]
    return hf, prompts


@pytest.mark.parametrize("backend", ["reference", "cpu_attn"])
def test_smollm2_gguf_matches_hf(backend, hf_reference, monkeypatch):
    from llmhal.engine.builder import EngineArgs, build_engine
    from llmhal.testing.model_parity import compare_with_hf

    monkeypatch.setenv("LLMHAL_GGUF_KERNEL", "dequant")
    hf, prompts = hf_reference
    engine, report = build_engine(
        EngineArgs(attention_backend=backend, max_model_len=256, kv_cache_memory_bytes=8 << 20)
    )
    assert report.architecture == "LlamaForCausalLM" and report.dtype == torch.float32
    result = compare_with_hf(
        hf, engine.runner.model, engine.config, prompts=prompts, decode_steps=12, rel_tol=1e-4
    )
    result.raise_on_failure()
    answer = engine.tokenizer.decode(result.tokens[0])
    assert "Paris" in answer, answer


def test_smollm2_json_answer_matches_hf_with_xgrammars_logits_processor(hf_reference, monkeypatch):
    """Structured outputs against a reference: transformers' greedy ``generate`` masked by
    xgrammar's own HF logits processor, and our engine with the xgrammar backend, give the same
    tokens for a JSON-schema answer (same weights, dequantized, in float32)."""
    xgr = pytest.importorskip("xgrammar")
    import json

    from xgrammar.contrib.hf import LogitsProcessor

    from llmhal import LLM, SamplingParams
    from llmhal.structured_output import StructuredOutputsParams

    monkeypatch.setenv("LLMHAL_GGUF_KERNEL", "dequant")
    hf, prompts = hf_reference
    schema = {"type": "object", "properties": {"capital": {"type": "string"}},
              "required": ["capital"], "additionalProperties": False}  # fmt: skip
    llm = LLM(max_model_len=256, kv_cache_memory_bytes=8 << 20, load_progress=False,
              structured_outputs_config={"backend": "xgrammar"})  # fmt: skip
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=so)
    ours = llm.generate({"prompt_token_ids": prompts[0]}, params)[0].outputs[0]
    tok = llm.get_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size, stop_token_ids=[tok.eos_token_id])  # fmt: skip
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)  # fmt: skip
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompts[0]]), attention_mask=torch.ones(1, len(prompts[0]), dtype=torch.long),
            max_new_tokens=30, do_sample=False, logits_processor=[LogitsProcessor(compiled)],
            eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
        )  # fmt: skip
    theirs = out[0, len(prompts[0]) :].tolist()
    assert ours.token_ids == theirs, (ours.text, tok.decode(theirs))
    assert ours.finish_reason == "stop" and "Paris" in json.loads(ours.text)["capital"]
