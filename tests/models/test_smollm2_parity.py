"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) through our Llama class against HF.

The HF reference is transformers' ``LlamaForCausalLM`` holding weights dequantized by the ``gguf``
package (independent of llmhal's own dequantization). Our model runs the exact GGUF path
(``LLMHAL_GGUF_KERNEL=dequant``), so the two compute with the same weights in float32.
"""

from __future__ import annotations

import json

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
        EngineArgs(
            attention_backend=backend,
            dtype="float32",
            max_model_len=256,
            kv_cache_memory_bytes=8 << 20,
        )
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
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20, load_progress=False,
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


class _AllowedTokens:
    """A transformers logits processor from a library's own next-tokens call: ``allowed(ids)``
    (the tokens generated so far) -> the token ids it allows next."""

    def __init__(self, allowed, prompt_len: int) -> None:
        self.allowed = allowed
        self.prompt_len = prompt_len

    def __call__(self, input_ids, scores):
        ids = input_ids[0, self.prompt_len :].tolist()
        keep = torch.full_like(scores, float("-inf"))
        keep[0, list(self.allowed(ids))] = 0
        return scores + keep


def _outlines_reference(tok, schema, backend):
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    guide = outlines_core.Guide(outlines_core.Index(build_regex_from_schema(json.dumps(schema), ""), backend.vocabulary))  # fmt: skip
    seen: list[int] = []

    def allowed(ids):
        for t in ids[len(seen) :]:  # the guide walks the same tokens, then lists the next ones
            guide.advance(t, return_tokens=False)
            seen.append(t)
        return guide.get_tokens()

    return allowed


def _lmfe_reference(tok, schema, backend):
    import lmformatenforcer as lmfe

    # The library's token-list mode (no bitmask), on the same vocabulary reading.
    data = lmfe.TokenEnforcerTokenizerData(backend.data.regular_tokens, backend.data.decoder, backend.data.eos_token_id, False, backend.vocab_size)  # fmt: skip
    parser = lmfe.JsonSchemaParser(schema)
    enforcer = lmfe.TokenEnforcer(data, parser)
    parser.config.force_json_field_order = True
    parser.config.max_consecutive_whitespaces = 0
    return lambda ids: enforcer.get_allowed_tokens(ids).allowed_tokens


def _guidance_reference(tok, schema, backend):
    import llguidance

    matcher = llguidance.LLMatcher(backend.ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False}))  # fmt: skip
    seen: list[int] = []

    def allowed(ids):
        for t in ids[len(seen) :]:
            assert matcher.consume_token(t)
            seen.append(t)
        mask = matcher.compute_logit_bias()  # the library's own per-token view: 200 = allowed
        return [i for i, b in enumerate(mask) if b]

    return allowed


@pytest.mark.parametrize(
    "backend, reference",
    [("guidance", _guidance_reference), ("outlines", _outlines_reference), ("lm-format-enforcer", _lmfe_reference)],
)  # fmt: skip
def test_smollm2_json_answer_matches_hf_under_each_librarys_own_token_lists(hf_reference, monkeypatch, backend, reference):  # fmt: skip
    """The other backends have no transformers processor that runs on transformers 5 (outlines-core
    and llguidance ship none; lm-format-enforcer's imports modules transformers 5 removed), so
    transformers' greedy ``generate`` is masked by each library's own next-token list, read
    through its plain API (not the bitmasks llmhal writes), and must give our engine's tokens."""
    pytest.importorskip({"guidance": "llguidance", "outlines": "outlines_core", "lm-format-enforcer": "lmformatenforcer"}[backend])  # fmt: skip
    from llmhal import LLM, SamplingParams
    from llmhal.structured_output import StructuredOutputsParams

    monkeypatch.setenv("LLMHAL_GGUF_KERNEL", "dequant")
    hf, prompts = hf_reference
    schema = {"type": "object", "properties": {"capital": {"type": "string"}, "country": {"type": "string"}},
              "required": ["capital", "country"], "additionalProperties": False}  # fmt: skip
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20, load_progress=False,
              structured_outputs_config={"backend": backend})  # fmt: skip
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=so)
    ours = llm.generate({"prompt_token_ids": prompts[0]}, params)[0].outputs[0]
    tok = llm.get_tokenizer()
    allowed = reference(tok, schema, llm.engine.structured_outputs().backend(backend))
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompts[0]]), attention_mask=torch.ones(1, len(prompts[0]), dtype=torch.long),
            max_new_tokens=30, do_sample=False, logits_processor=[_AllowedTokens(allowed, len(prompts[0]))],
            eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
        )  # fmt: skip
    theirs = out[0, len(prompts[0]) :].tolist()
    # llguidance stops at the closing brace (nothing can follow it) where transformers samples the
    # EOS its list allows there: the same answer, one EOS apart.
    if backend == "guidance" and theirs[-1:] == [tok.eos_token_id]:
        theirs = theirs[:-1]
    assert ours.token_ids == theirs, (ours.text, tok.decode(theirs))
    assert ours.finish_reason == "stop" and "Paris" in json.loads(ours.text)["capital"]
