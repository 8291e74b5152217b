"""DFlash ("dflash"): a tiny random block-diffusion head in the published layout (Qwen3-style
layers with q/k norms, fc over two target layers, hidden_norm, dflash_config), built here from
transformers' Qwen3 modules. One pass of the head fills a block of masked positions; its drafts
equal a transformers reference recomputed from the whole context, greedy output equals plain
decoding (batched, preempted), and heads that do not fit are refused before anything loads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

LAYER_IDS = [1, 3]  # outputs of target layers 1 and 3 = transformers' hidden_states[2], [4]
BLOCK, MASK = 5, 383


def _sibling(name):
    spec = importlib.util.spec_from_file_location(f"_spec_decode_{name}", Path(__file__).with_name(f"{name}.py"))  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


E1 = _sibling("test_eagle")  # plain_answers, record_drafts


class Reference(nn.Module):
    """DFlash's head in transformers' Qwen3 modules, run over the whole context every time."""

    def __init__(self, cfg, target_hidden: int) -> None:
        import transformers.models.qwen3.modeling_qwen3 as Q

        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.fc = nn.Linear(len(LAYER_IDS) * target_hidden, h, bias=False)
        self.hidden_norm, self.norm = Q.Qwen3RMSNorm(h, cfg.rms_norm_eps), Q.Qwen3RMSNorm(h, cfg.rms_norm_eps)  # fmt: skip
        self.layers = nn.ModuleList()
        for _ in range(cfg.num_hidden_layers):
            layer = nn.Module()
            layer.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
            layer.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
            layer.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
            layer.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
            layer.q_norm, layer.k_norm = Q.Qwen3RMSNorm(d, cfg.rms_norm_eps), Q.Qwen3RMSNorm(d, cfg.rms_norm_eps)  # fmt: skip
            layer.mlp = Q.Qwen3MLP(cfg)
            layer.input_layernorm = Q.Qwen3RMSNorm(h, cfg.rms_norm_eps)
            layer.post_attention_layernorm = Q.Qwen3RMSNorm(h, cfg.rms_norm_eps)
            self.layers.append(layer)
        for m in self.modules():  # norms not all ones, so one left out shows
            if isinstance(m, Q.Qwen3RMSNorm):
                m.weight.data = 1 + 0.2 * torch.randn_like(m.weight)
        self.rope = Q.Qwen3RotaryEmbedding(cfg)
        self.rotate = Q.apply_rotary_pos_emb

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"fc.weight": self.fc.weight, "hidden_norm.weight": self.hidden_norm.weight, "norm.weight": self.norm.weight}  # fmt: skip
        for i, layer in enumerate(self.layers):
            for k, v in layer.state_dict().items():
                top = k.split(".")[0]
                where = "self_attn." if top in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm") else ""  # fmt: skip
                out[f"layers.{i}.{where}{k}"] = v
        return {k: v.detach().contiguous() for k, v in out.items()}

    def drafts(self, hf_target, ctx: list[int], k: int) -> list[int]:
        cfg, d = self.cfg, self.cfg.head_dim
        with torch.no_grad():
            hs = hf_target(torch.tensor([ctx]), output_hidden_states=True).hidden_states
            c = self.hidden_norm(self.fc(torch.cat([hs[i + 1][0] for i in LAYER_IDS], -1)[:-1]))
            ids = torch.tensor([ctx[-1]] + [MASK] * (BLOCK - 1))
            x = hf_target.get_input_embeddings()(ids)
            m = c.shape[0]
            cos, sin = self.rope(x, torch.arange(m + BLOCK)[None])
            for layer in self.layers:
                a = layer.input_layernorm(x)
                q = layer.q_norm(layer.q_proj(a).view(BLOCK, -1, d)).transpose(0, 1)[None]
                keys = layer.k_norm(layer.k_proj(torch.cat([c, a])).view(m + BLOCK, -1, d)).transpose(0, 1)[None]  # fmt: skip
                vals = layer.v_proj(torch.cat([c, a])).view(m + BLOCK, -1, d).transpose(0, 1)[None]
                q, _ = self.rotate(q, q, cos[:, m:], sin[:, m:])
                keys, _ = self.rotate(keys, keys, cos, sin)
                rep = cfg.num_attention_heads // cfg.num_key_value_heads
                att = torch.nn.functional.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1))  # fmt: skip
                x = x + layer.o_proj(att[0].transpose(0, 1).reshape(BLOCK, -1))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            logits = hf_target.lm_head(self.norm(x[1:]))
            return logits.argmax(-1)[:k].tolist()


def make_dflash_head(folder, target_cfg, seed=0, **dflash):
    import transformers

    torch.manual_seed(seed)
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings")  # fmt: skip
    cfg = transformers.Qwen3Config(**{k: getattr(target_cfg, k) for k in names}, num_hidden_layers=2, head_dim=16)  # fmt: skip
    ref = Reference(cfg, target_cfg.hidden_size).eval()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(ref.tensors(), str(folder / "model.safetensors"))
    extra = {"target_layer_ids": LAYER_IDS, "block_size": BLOCK, "mask_token_id": MASK} | dflash
    d = cfg.to_dict() | {"architectures": ["DFlashDraftModel"], "dflash_config": extra}
    (folder / "config.json").write_text(json.dumps(d))
    return ref


_llm = E1.llm_over


@pytest.fixture(scope="module")
def deep(tiny_models):
    return E1.deep_target(tiny_models)


@pytest.fixture(scope="module")
def head(tmp_path_factory, deep):
    folder = tmp_path_factory.mktemp("dflash_head")
    return str(folder), make_dflash_head(folder, deep[1].config)


def test_block_drafts_equal_the_transformers_reference(deep, head, monkeypatch):
    folder, hf, base = deep
    llm = _llm(folder, {"method": "dflash", "model": head[0], "num_speculative_tokens": BLOCK - 1})
    calls = E1.replayed_calls(llm, base, monkeypatch)
    for ctx, _, _, drafts in calls:
        assert drafts == head[1].drafts(hf, ctx, len(drafts))


def test_greedy_batched_and_preempted_equals_plain_decoding(deep, head, monkeypatch):
    folder, _, base = deep
    spec = {"method": "dflash", "model": head[0], "num_speculative_tokens": 3}
    E1.check_batched_and_preempted(folder, base, spec, monkeypatch)


def test_heads_that_do_not_fit_are_refused(tmp_path, deep):
    folder, hf, _ = deep
    cases = [
        ({}, 5, "blocks of 5.*num_speculative_tokens <= 4"),
        ({"target_layer_ids": [1, 5]}, 2, r"target_layer_ids \(each 0..4"),
        ({"mask_token_id": None}, 2, "mask_token_id"),
    ]
    for i, (over, k, words) in enumerate(cases):
        where = tmp_path / f"h{i}"
        make_dflash_head(where, hf.config, **over)
        with pytest.raises(ValueError, match=words):
            _llm(folder, {"method": "dflash", "model": str(where), "num_speculative_tokens": k})
    wide = tmp_path / "wide"
    make_dflash_head(wide, hf.config)
    cfg = json.loads((wide / "config.json").read_text()) | {"hidden_size": 96}
    (wide / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size=96.*target's hidden_size is 64"):
        _llm(folder, {"method": "dflash", "model": str(wide), "num_speculative_tokens": 2})
