"""EAGLE-3 ("eagle3"): a tiny random head in the published layout (fc over three target layers,
``midlayer`` with its 2H-wide attention input and hidden_norm, its own norm and LM head over a
draft vocabulary, d2t/t2d maps) built here from transformers' Llama modules. Its drafts equal a
transformers reference, the target's layer inputs it is handed equal transformers' hidden states,
greedy output equals plain decoding (batched, preempted), and heads that do not fit are refused."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from llmhal import SamplingParams

DRAFT_VOCAB = 128


def _eagle_tests():
    spec = importlib.util.spec_from_file_location("_spec_decode_test_eagle", Path(__file__).with_name("test_eagle.py"))  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


E1 = _eagle_tests()  # the head-independent helpers
PROMPTS = E1.PROMPTS


class Reference(nn.Module):
    """The EAGLE-3 head in transformers' modules (the attention's q/k/v widened to 2H inputs)."""

    def __init__(self, cfg, target_hidden: int, draft_vocab: int) -> None:
        import transformers.models.llama.modeling_llama as L

        super().__init__()
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * target_hidden, h, bias=False)
        self.attn = L.LlamaAttention(cfg, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self.attn, name)
            setattr(self.attn, name, nn.Linear(2 * h, old.out_features, bias=False))
        self.mlp = L.LlamaMLP(cfg)
        self.norms = nn.ModuleDict({n: L.LlamaRMSNorm(h, cfg.rms_norm_eps) for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm")})  # fmt: skip
        for norm in self.norms.values():  # not all ones, so a norm left out shows
            norm.weight.data = 1 + 0.2 * torch.randn(h)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.rope = L.LlamaRotaryEmbedding(cfg)

    def tensors(self, d2t: torch.Tensor, t2d: torch.Tensor) -> dict[str, torch.Tensor]:
        n = self.norms
        out = {"fc.weight": self.fc.weight, "norm.weight": n["norm"].weight, "lm_head.weight": self.lm_head.weight, "d2t": d2t, "t2d": t2d}  # fmt: skip
        out |= {f"midlayer.{k}.weight": n[k].weight for k in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}  # fmt: skip
        out |= {f"midlayer.self_attn.{k}": v for k, v in self.attn.state_dict().items()}
        out |= {f"midlayer.mlp.{k}": v for k, v in self.mlp.state_dict().items()}
        return {k: v.detach().contiguous() for k, v in out.items()}

    def layer(self, emb: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The midlayer over a whole sequence at positions 0.. (causal)."""
        n = self.norms
        x = torch.cat([n["input_layernorm"](emb), n["hidden_norm"](g)], -1)[None]
        pos = self.rope(x, torch.arange(x.shape[1])[None])
        h = g + self.attn(x, pos, None)[0][0]
        return h + self.mlp(n["post_attention_layernorm"](h))


def make_eagle3_head(folder, target_cfg, seed=0, layer_ids=None, d2t=True, **over):
    torch.manual_seed(seed)
    cfg = E1.head_config(target_cfg, **over)
    ref = Reference(cfg, target_cfg.hidden_size, DRAFT_VOCAB).eval()
    # The draft vocabulary: a random subset of the target's, in order (d2t holds the offsets).
    kept = torch.randperm(target_cfg.vocab_size)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(target_cfg.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    tensors = ref.tensors(kept - torch.arange(DRAFT_VOCAB), t2d)
    if not d2t:
        del tensors["d2t"], tensors["t2d"]
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    d = cfg.to_dict() | {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_VOCAB}  # fmt: skip
    if layer_ids is not None:
        d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids}
    (folder / "config.json").write_text(json.dumps(d))
    ref.d2t = kept
    return ref


def taps(hf_target, ctx, layers):
    """The inputs of ``layers`` at every position, concatenated (transformers' hidden_states[i]
    is the input of layer i)."""
    hs = hf_target(torch.tensor([ctx]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in layers], -1)


def reference_drafts(hf_target, ref, layers, ctx, k):
    with torch.no_grad():
        emb = hf_target.get_input_embeddings()
        e = emb(torch.tensor(ctx[1:]))
        g = ref.fc(taps(hf_target, ctx, layers)[:-1])
        drafts = []
        for _ in range(k):
            out = ref.layer(e, g)
            d = int(ref.lm_head(ref.norms["norm"](out[-1])).argmax())
            drafts.append(int(ref.d2t[d]))
            e = torch.cat([e, emb(torch.tensor(drafts[-1:]))])
            g = torch.cat([g, out[-1:]])  # later steps: the head's own output, not fused again
        return drafts


def reference_logits(hf_target, ref, layers, ctx, after):
    """The head's draft-vocabulary logits after ``ctx`` and the draft tokens ``after``."""
    with torch.no_grad():
        emb = hf_target.get_input_embeddings()
        e = emb(torch.tensor(ctx[1:]))
        g = ref.fc(taps(hf_target, ctx, layers)[:-1])
        for t in [*after, None]:
            out = ref.layer(e, g)
            if t is None:
                return ref.lm_head(ref.norms["norm"](out[-1]))
            e = torch.cat([e, emb(torch.tensor([t]))])
            g = torch.cat([g, out[-1:]])


_llm = E1.llm_over


@pytest.fixture(scope="module")
def deep(tiny_models):
    return E1.deep_target(tiny_models)


@pytest.fixture(scope="module")
def head3(tmp_path_factory, deep):
    folder = tmp_path_factory.mktemp("eagle3_head")
    return str(folder), make_eagle3_head(folder, deep[1].config)


def test_drafts_and_layer_taps_equal_the_transformers_reference(deep, head3, monkeypatch):
    folder, hf, base = deep
    llm = _llm(folder, {"method": "eagle3", "model": head3[0], "num_speculative_tokens": 3})
    calls = E1.replayed_calls(llm, base, monkeypatch)
    for ctx, start, hidden, drafts in calls:
        with torch.no_grad():
            want = taps(hf, ctx, (2, 3, 3))[start : len(ctx) - 1]
        torch.testing.assert_close(hidden, want, atol=1e-4, rtol=1e-4)
        assert drafts == reference_drafts(hf, head3[1], (2, 3, 3), ctx, len(drafts))
        assert all(head3[1].d2t.eq(t).any() for t in drafts)  # only draft-vocabulary tokens


def test_greedy_batched_and_preempted_equals_plain_decoding(deep, head3, monkeypatch):
    folder, _, base = deep
    spec = {"method": "eagle3", "model": head3[0], "num_speculative_tokens": 4}
    E1.check_batched_and_preempted(folder, base, spec, monkeypatch)


def test_layer_ids_from_the_heads_config_and_refusals(tmp_path, tiny_models, new_llm, base_llm):
    hf = tiny_models("llama")[1]  # 2 layers: the default taps do not exist
    plain_head = tmp_path / "default_ids"
    make_eagle3_head(plain_head, hf.config)
    ids_error = r"\[2, 1, -1\].*2 layers.*eagle_aux_hidden_state_layer_ids"
    with pytest.raises(ValueError, match=ids_error):
        new_llm({"method": "eagle3", "model": str(plain_head), "num_speculative_tokens": 2})
    own = tmp_path / "own_ids"
    make_eagle3_head(own, hf.config, layer_ids=[0, 1, 1])
    llm = new_llm({"method": "eagle3", "model": str(own), "num_speculative_tokens": 2})
    assert llm.engine.runner.model.model.aux_hidden_state_layers == (0, 1, 1)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in base_llm.generate(PROMPTS, params)]  # fmt: skip
    wide = tmp_path / "wide"
    make_eagle3_head(wide, hf.config, layer_ids=[0, 1, 1])
    cfg = json.loads((wide / "config.json").read_text()) | {"target_hidden_size": 96}
    (wide / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"target_hidden_size=96.*target's hidden_size is 64"):
        new_llm({"method": "eagle3", "model": str(wide), "num_speculative_tokens": 2})
    no_map = tmp_path / "no_d2t"
    make_eagle3_head(no_map, hf.config, layer_ids=[0, 1, 1], d2t=False)
    with pytest.raises(ValueError, match="no d2t map"):
        new_llm({"method": "eagle3", "model": str(no_map), "num_speculative_tokens": 2})


def test_tree_drafts_equal_the_reference_node_by_node(deep, head3, monkeypatch):
    folder, hf, base = deep
    spec = {"method": "eagle3", "model": head3[0], "num_speculative_tokens": 3, "speculative_token_tree": E1.TREE}  # fmt: skip
    ref, layers = head3[1], (2, 3, 3)
    E1.check_tree_calls(
        _llm(folder, spec), base, monkeypatch,
        lambda ctx: taps(hf, ctx, layers),
        lambda ctx, after: reference_logits(hf, ref, layers, ctx, after),
        lambda ctx, k: reference_drafts(hf, ref, layers, ctx, k),
        lambda i: int(ref.d2t[i]),
    )  # fmt: skip
