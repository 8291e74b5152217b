"""Tiny Llama/Qwen/MoE/DeepSeek models split over two ranks (gloo, spawned processes) give the
logits and greedy tokens of the same model in one process: tensor parallel (heads, MLP and
vocabulary split; KV heads replicated when fewer than ranks; experts split along their
intermediate size; DeepSeek's MLA split by head, its latent cache whole on each rank) and
pipeline parallel (layers split in two stages, the hidden state and residual sent between them).

Each run is one flattened prefill of several prompts then batched greedy decode steps over a paged
KV cache, as the engine runs them (llmhal.testing.model_parity.PagedRunner).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llmhal.distributed.launch import run_ranks

PROMPTS = [[5, 17, 42, 90, 7], [3, 50, 11], [8]]  # ids < 96, the tiny GGUF vocabulary
STEPS = 4


class _Stage:
    """Makes a pipeline stage look like a whole model to PagedRunner: a stage after the first
    receives the previous stage's IntermediateTensors, a stage before the last sends its own
    (and returns zero logits, which the test ignores)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.tokens = 0

    def modules(self) -> Any:
        return self.model.modules()

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> Any:
        from llmhal.distributed import get_pp_group
        from llmhal.distributed.pipeline import IntermediateTensors

        pp = get_pp_group()
        self.tokens = positions.shape[0]
        if pp.world_size == 1:  # models without pipeline stages take no intermediate_tensors
            return self.model(ids, positions)
        previous = None if pp.is_first_rank else IntermediateTensors(pp.recv_tensor_dict())
        out = self.model(ids, positions, intermediate_tensors=previous)
        if not pp.is_last_rank:
            pp.send_tensor_dict(out.tensors)
            return None
        return out

    def compute_logits(self, hidden: Any) -> torch.Tensor:
        if hidden is None:
            return torch.zeros(self.tokens, self.model.config.vocab_size)
        return self.model.compute_logits(hidden)


def _greedy_run(model: Any, config: Any) -> list[dict[int, torch.Tensor]]:
    """Logits of every step: the prefill of PROMPTS, then STEPS greedy decode steps."""
    from llmhal.distributed import get_pp_group
    from llmhal.testing.model_parity import PagedRunner

    pp = get_pp_group()
    runner = PagedRunner(model, config)
    steps = [runner.step(list(enumerate(PROMPTS)))]
    for _ in range(STEPS):
        # The last stage picks the tokens; every stage feeds them to the next step (as the
        # engine's driver does).
        chosen = {rid: int(logits.argmax()) for rid, logits in steps[-1].items()}
        chosen = pp.broadcast_object(chosen, src=pp.world_size - 1)
        steps.append(runner.step([(rid, [tok]) for rid, tok in chosen.items()]))
    return steps


def _build(path: str) -> tuple[Any, Any]:
    """(model, engine config): a safetensors folder as the parity kit loads it, a GGUF file (or
    ``folder#quantization``) as the engine does (this rank's shard either way)."""
    path, _, quantization = path.partition("#")
    if not path.endswith(".gguf") and not quantization:
        from llmhal.testing.model_parity import build_model

        return build_model(path)
    from llmhal.distributed import get_pp_group, get_tp_group
    from llmhal.engine.builder import EngineArgs, load_model, resolve_engine_config
    from llmhal.model_loader.source import resolve_source
    from llmhal.platforms import get_current_platform

    tp, pp = get_tp_group().world_size, get_pp_group().world_size
    args = EngineArgs(model=path, dtype="float32", tensor_parallel_size=tp)
    args.quantization = quantization or None
    args.pipeline_parallel_size = pp
    args.distributed_executor_backend = "mp" if tp * pp > 1 else None
    config, ckpt, cls = resolve_engine_config(args, get_current_platform(), resolve_source(path))
    return load_model(config, ckpt, cls).model, config


def _rank_run(rank: int, folders: list[str]) -> list[Any]:
    from llmhal.distributed import get_pp_group

    out = []
    for folder in folders:
        model, config = _build(folder)
        runs = _greedy_run(_Stage(model), config)
        out.append(runs if get_pp_group().is_last_rank else None)
    return out


def _single_process(folders: list[str]) -> list[list[dict[int, torch.Tensor]]]:
    return [_greedy_run(*_build(f)) for f in folders]


def _assert_same(
    parallel: list[dict[int, torch.Tensor]],
    single: list[dict[int, torch.Tensor]],
    atol: float = 2e-4,
):
    assert len(parallel) == len(single)
    for step, (p, s) in enumerate(zip(parallel, single, strict=True)):
        for rid in s:
            # Greedy tokens equal, logits equal up to float32 summation order (all-reduce).
            assert int(p[rid].argmax()) == int(s[rid].argmax()), f"step {step}, prompt {rid}"
            torch.testing.assert_close(p[rid], s[rid], atol=atol, rtol=1e-4)


# qwen2 with 6 heads over 3 KV heads (as the default model's 9 over 3): q/k/v biases, and an
# uneven split by KV group (4 + 2 query heads); qwen3: per-head q/k norms; llama_untied with one KV
# head: the head replicated on both ranks, and an untied LM head.
UNEVEN = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}
TP_MODELS = [("qwen2", UNEVEN), ("qwen3", {}), ("llama_untied", {"num_key_value_heads": 1})]
# llama: tied embeddings, so the last stage's LM head loads the first stage's embedding table.
PP_MODELS = [("llama", {}), ("qwen3", {})]


# MoE: Qwen2-MoE's experts split along their intermediate size (plus its shared expert, a dense
# MLP) under TP; Mixtral's three layers over two stages under PP (and DeepSeek's, below).
MOE_INIT = {"initializer_range": 0.1}  # the router, not rounding, decides the experts
MOE_TP = ("Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, **MOE_INIT})  # fmt: skip
MOE_PP = ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, **MOE_INIT})
# DeepSeek-V3 under TP: MLA's heads split (q_b_proj, kv_b_proj by head, o_proj by its inputs; the
# latent projection and cache whole on every rank), the routed experts split along their
# intermediate size, the shared expert and the first, dense layer's MLP split as dense MLPs;
# grouped top-k with the bias correction.
DEEPSEEK_TP = ("DeepseekV3ForCausalLM", {
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4,
    "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 1.5, **MOE_INIT})  # fmt: skip


def _folders(tiny_models, models) -> list[str]:
    return [tiny_models(arch, **over)[0] for arch, over in models]


def _moe_folder(tmp_path_factory, arch: str, overrides: dict[str, Any]) -> str:
    from llmhal.testing.model_parity import save_tiny_model, tiny_config

    folder = tmp_path_factory.mktemp(arch)
    save_tiny_model(tiny_config(arch, **overrides), folder)
    return str(folder)


def _deepseek_gguf(tmp_path_factory) -> str:
    """DeepSeek-V2-Lite's layout (q_proj, no query LoRA; softmax top-k) as llama.cpp's newer
    converter writes it (kv_b_proj split into attn_k_b / attn_v_b, Q8_0 matrices, Q4_0/Q8_0
    experts), sized so that each rank's share of a Q8_0 matrix's inputs is whole blocks of 32."""
    from llmhal.testing.model_parity import save_tiny_model, tiny_config
    from tests.models.test_gguf_deepseek import write_deepseek_gguf

    arch, kw = DEEPSEEK_TP
    kw = {**kw, "q_lora_rank": None, "n_group": 1, "topk_group": 1, "intermediate_size": 128,
          "moe_intermediate_size": 64}  # fmt: skip
    folder = tmp_path_factory.mktemp("deepseek-gguf")
    hf = save_tiny_model(tiny_config("DeepseekV2ForCausalLM", **kw), folder)
    write_deepseek_gguf(hf, folder / "model.gguf", split_kv_b=True)
    return str(folder / "model.gguf")


def _gguf_file(tmp_path_factory) -> str:
    """A tiny Llama in GGUF, Q8_0 weights (32-weight blocks: each rank's o_proj and down_proj
    inputs are whole blocks) and a Q4_0 embedding table split by vocabulary rows."""
    from llmhal.testing.gguf_files import write_tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny-q8.gguf"
    write_tiny_gguf(path, weight_type="Q8_0", types={"token_embd": "Q4_0"}, seed=3)
    return str(path)


@pytest.fixture(scope="module")
def tp2(tiny_models, tmp_path_factory):
    folders = _folders(tiny_models, TP_MODELS) + [_moe_folder(tmp_path_factory, *MOE_TP)]
    folders.append(_gguf_file(tmp_path_factory))
    folders.append(folders[3] + "#experts_int8")  # the MoE model, experts quantized on load
    deepseek = _moe_folder(tmp_path_factory, *DEEPSEEK_TP)
    folders += [deepseek, deepseek + "#experts_int8", _deepseek_gguf(tmp_path_factory)]
    return run_ranks(_rank_run, 2, 1, folders), _single_process(folders)


@pytest.fixture(scope="module")
def pp2(tiny_models, tmp_path_factory):
    folders = _folders(tiny_models, PP_MODELS) + [_moe_folder(tmp_path_factory, *MOE_PP)]
    folders.append(_moe_folder(tmp_path_factory, *DEEPSEEK_TP))
    return run_ranks(_rank_run, 1, 2, folders), _single_process(folders)


TP_IDS = [
    "qwen2_uneven_heads",
    "qwen3",
    "llama_untied_one_kv_head",
    "qwen2_moe",
    "llama_gguf_q8",
    "qwen2_moe_experts_int8",
    "deepseek_v3_mla",
    "deepseek_v3_experts_int8",
    "deepseek_v2_gguf_q_proj",
]


@pytest.mark.parametrize("index", range(len(TP_IDS)), ids=TP_IDS)
def test_tensor_parallel_two_ranks_equal_one_process(tp2, index):
    ranks, single = tp2
    # experts_int8 quantizes each rank's slice of the down projections with its own row scales:
    # the same greedy tokens, logits within int8 rounding of one process's (measured 2.6e-3).
    atol = 1e-2 if TP_IDS[index].endswith("experts_int8") else 2e-4
    for rank in ranks:  # every rank computes the full logits (all-gathered)
        _assert_same(rank[index], single[index], atol)


@pytest.mark.parametrize(
    "index", range(len(PP_MODELS) + 2), ids=[*(a for a, _ in PP_MODELS), "mixtral", "deepseek_v3"]
)
def test_pipeline_parallel_two_stages_equal_one_process(pp2, index):
    ranks, single = pp2
    assert ranks[0][index] is None  # the first stage hands its output on
    _assert_same(ranks[1][index], single[index])


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_four_ranks(tiny_models):
    folders = _folders(tiny_models, [("qwen3", {})])
    ranks = run_ranks(_rank_run, 2, 2, folders)
    single = _single_process(folders)
    for rank in ranks[2:]:  # the last stage's two tensor-parallel ranks
        _assert_same(rank[0], single[0])


def test_a_stage_holds_only_its_layers(tiny_models):
    """Stage layout without processes: the layer split, and what each stage's model holds."""
    from llmhal.distributed.pipeline import PPMissingLayer, stage_layers

    assert [stage_layers(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [stage_layers(4, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="at most 2 stages"):
        stage_layers(2, 0, 3)
    assert isinstance(PPMissingLayer(), torch.nn.Module)


def test_pipeline_stages_of_a_model_without_them_are_refused_with_the_remedy(tiny_models):
    """Mamba's model is one stage (its layers are not built per stage): asking for two stages is
    refused before a weight loads, naming what still applies."""
    from llmhal.engine.builder import EngineArgs, resolve_engine_config
    from llmhal.model_loader.source import resolve_source
    from llmhal.platforms import get_current_platform

    folder, _ = tiny_models("mamba")
    args = EngineArgs(model=folder, dtype="float32", pipeline_parallel_size=2)
    args.distributed_executor_backend = "mp"
    refusal = r"MambaForCausalLM does not split into pipeline stages; use pipeline_parallel_size=1 \(tensor parallelism"  # fmt: skip
    with pytest.raises(ValueError, match=refusal):
        resolve_engine_config(args, get_current_platform(), resolve_source(folder))


def test_mla_heads_the_ranks_do_not_divide_are_refused(tmp_path_factory, monkeypatch):
    """MLA splits by head: 4 heads over 3 ranks is refused while the model is built, naming the
    layer and the remedy."""
    import llmhal.layers.linear as linear
    import llmhal.models.deepseek_v2 as deepseek
    from llmhal.testing.model_parity import build_model

    folder = _moe_folder(tmp_path_factory, *DEEPSEEK_TP)
    for module in (linear, deepseek):  # the model file holds its own reference
        monkeypatch.setattr(module, "tp_rank_and_size", lambda: (0, 3))
    refusal = r"self_attn\.num_attention_heads: attention heads \(4\) does not split into 3 equal parts; use a tensor_parallel_size that divides it"  # fmt: skip
    with pytest.raises(ValueError, match=refusal):
        build_model(folder)
