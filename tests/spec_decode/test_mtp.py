"""MTP on a tiny random DeepSeek-V3 whose checkpoint carries one multi-token-prediction layer: the
first draft equals the MTP layer computed with transformers' own DeepSeek-V3 decoder layer (the
reference), greedy output equals plain decoding token for token (batched, with preemption), and
models without MTP layers are refused before loading."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from llmhal import SamplingParams
from llmhal.spec_decode.proposer import DraftRequest


def _deepseek_common() -> dict:
    """test_deepseek's tiny DeepSeek config (test folders are not packages here)."""
    path = Path(__file__).parents[1] / "models" / "test_deepseek.py"
    spec = importlib.util.spec_from_file_location("_deepseek_cases", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.COMMON


# DeepSeek-V3's routing and a q LoRA, two decoder layers, and one MTP layer after them.
CONFIG = {
    **_deepseek_common(),
    "q_lora_rank": 24,
    "n_group": 4,
    "topk_group": 2,
    "num_hidden_layers": 2,
    "num_nextn_predict_layers": 1,
}
PROMPTS = [
    {"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7]},
    {"prompt_token_ids": list(range(30, 60))},
    {"prompt_token_ids": [100, 200, 100, 200, 100]},
    {"prompt_token_ids": [9]},
]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory):
    """(folder, HF target, HF model whose last layer is the MTP block, the MTP extras)."""
    from safetensors.torch import load_file, save_file

    from llmhal.testing.model_parity import save_tiny_model, tiny_config
    from llmhal.testing.tiny_models import make_tokenizer

    folder = tmp_path_factory.mktemp("deepseek_mtp")
    cfg = tiny_config("DeepseekV3ForCausalLM", **CONFIG)
    hf = save_tiny_model(cfg, folder)
    n = cfg.num_hidden_layers
    # The MTP block: the last layer of a model one layer deeper (transformers' own weights).
    deeper = save_tiny_model(tiny_config("DeepseekV3ForCausalLM", **{**CONFIG, "num_hidden_layers": n + 1}), folder / "deeper", seed=1)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    h = cfg.hidden_size
    extras = {
        "enorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
        "hnorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
        "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * 0.1,
        "shared_head.norm.weight": 1 + 0.2 * torch.randn(h, generator=g),
        "shared_head.head.weight": hf.lm_head.weight.detach().clone(),
        "embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone(),
    }
    tensors = load_file(str(folder / "model.safetensors"))
    prefix = f"model.layers.{n}."
    for name, t in deeper.state_dict().items():
        if name.startswith(prefix):
            tensors[name] = t.contiguous()
    tensors.update({prefix + k: v.contiguous() for k, v in extras.items()})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    make_tokenizer(cfg.vocab_size).save_pretrained(str(folder))
    return str(folder), hf, deeper, extras


def _llm(folder, spec=None, **kw):
    from llmhal import LLM

    kw.setdefault("max_model_len", 128)
    return LLM(folder, dtype="float32", speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def plain_llm(deepseek_mtp):
    return _llm(deepseek_mtp[0])


@pytest.fixture(scope="module")
def mtp_llm(deepseek_mtp):
    return _llm(deepseek_mtp[0], {"method": "mtp", "num_speculative_tokens": 2})


def _reference_first_draft(hf, deeper, extras, ids):
    """The MTP layer over positions 0..len-2 by hand, with transformers' decoder layer."""
    n = hf.config.num_hidden_layers
    x = torch.tensor([ids])
    with torch.no_grad():
        hidden = hf(x, output_hidden_states=True).hidden_states[-1][0]  # after the final norm

        def rms(v, w):
            eps = hf.config.rms_norm_eps
            return w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps))

        emb = hf.model.embed_tokens(x[0, 1:])
        emb[0] = 0  # position 0's embedding is masked
        inp = torch.cat([rms(emb, extras["enorm.weight"]), rms(hidden[:-1], extras["hnorm.weight"])], -1)  # fmt: skip
        y = (inp @ extras["eh_proj.weight"].T)[None]
        t = y.shape[1]
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        cos_sin = deeper.model.rotary_emb(y, pos)
        out = deeper.model.layers[n](y, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)  # fmt: skip
        out = out[0] if isinstance(out, tuple) else out
        logits = rms(out[0, -1], extras["shared_head.norm.weight"]) @ extras["shared_head.head.weight"].T  # fmt: skip
    return int(logits.argmax())


def test_first_draft_equals_the_mtp_layer_computed_with_transformers(mtp_llm, deepseek_mtp):
    _, hf, deeper, extras = deepseek_mtp
    engine = mtp_llm.engine
    proposer = engine.speculator.proposer
    for ids in ([5, 6, 7, 8, 5, 6, 7], list(range(30, 60))):
        # The target's hidden states from transformers (equal to llmhal's within 1e-4).
        with torch.no_grad():
            hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        rid = f"ref-{len(ids)}"
        req = DraftRequest(rid, ids[:-1], [ids[-1]], 1, hidden[:-1], 0)
        with torch.no_grad():
            (draft,) = proposer.propose([req])
        proposer.finish(rid)
        assert draft == [_reference_first_draft(hf, deeper, extras, ids)]


def test_greedy_equals_plain_decoding_batched(plain_llm, mtp_llm):
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(PROMPTS, GREEDY)]
    spec = [o.outputs[0].token_ids for o in mtp_llm.generate(PROMPTS, GREEDY)]
    assert spec == plain
    stats = mtp_llm.engine.speculator.stats
    assert stats.num_drafts > 0
    proposer = mtp_llm.engine.speculator.proposer
    assert not proposer.states  # every request's MTP blocks came back
    assert len(proposer.free) == proposer.runner.num_blocks


def test_preemption_and_prefix_caching(plain_llm, deepseek_mtp):
    per_block = plain_llm.engine.runner.kv_cache_bytes_per_block()
    small = _llm(
        deepseek_mtp[0], {"method": "mtp", "num_speculative_tokens": 2},
        kv_cache_memory_bytes=5 * per_block, max_num_batched_tokens=16, max_num_seqs=4,
    )  # fmt: skip
    prompts = PROMPTS + PROMPTS
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, GREEDY)]
    assert [o.outputs[0].token_ids for o in small.generate(prompts, GREEDY)] == plain
    assert small.engine.stats.preemptions > 0


def test_models_without_mtp_layers_are_refused(tiny_models):
    folder = tiny_models("llama")[0]
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        _llm(folder, {"method": "mtp", "num_speculative_tokens": 2})
