"""Mamba-1, FalconMamba, Mamba-2 (and LFM2's F16/Q8_0 files) from llama.cpp-format GGUF files
against transformers.

Each tiny random HF model (the session ``tiny_models``) is written as llama.cpp's converter writes
it (``convert_hf_to_gguf.py``, MambaModel / Mamba2Model): architecture ``mamba`` (FalconMamba: with
``ssm.dt_b_c_rms``) or ``mamba2``, the ``ssm.*`` metadata, ``A_log`` stored as ``A = -exp(A_log)``,
the conv weight without its unit axis, Mamba-2's ``dt_bias`` as ``ssm_dt.bias``, its A and D as
``[heads, 1]`` and its gated norm as ``[groups, inner / groups]``, the tied head omitted; 1-D
tensors, norms, the conv and A/D in F32, the matrices in the file's type (F16 where a row does not
fill whole Q8_0 blocks, as the converter falls back). For F16 and Q8_0 the file's matrices are read
back, dequantized by the gguf package, into a copy of the transformers model, which is then the
reference: the engine must run the file's weights, so greedy tokens and log-probabilities must
match it as for F32.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from llmhal.testing.engine_parity import PROMPTS, compare_with_references, hf_references

KW = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, enforce_eager=True)
STEPS = 24
EXPERT_PARAM = {"gate_proj.weight": "gate_up_proj", "up_proj.weight": "gate_up_proj",
                "down_proj.weight": "down_proj"}  # fmt: skip


def write_ssm_gguf(
    hf,
    path,
    weight_type: str = "F32",
    tokenizer_folder: str | None = None,
    float_only: tuple[str, ...] = ("_norm.weight", "ssm_conv1d.weight"),
) -> None:
    """Write ``hf`` (Mamba, FalconMamba or Mamba-2) as llama.cpp's converter does, with the byte-level
    BPE tokenizer of ``tokenizer_folder`` if given; matrices whose names end in ``float_only`` stay
    F32, as the converter keeps them."""
    import gguf

    c = hf.config
    arch = "mamba2" if c.model_type == "mamba2" else "mamba"
    inner = int(c.expand * c.hidden_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(2**20)  # the converter's placeholders, which the loader must ignore
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_ssm_conv_kernel(c.conv_kernel)
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(c.state_size)
    w.add_layer_norm_rms_eps(c.layer_norm_epsilon)
    if arch == "mamba":
        w.add_ssm_time_step_rank(c.time_step_rank)
        w.add_ssm_dt_b_c_rms(c.model_type == "falcon_mamba")
    else:
        w.add_ssm_time_step_rank(inner // c.head_dim)  # the head count
        w.add_ssm_group_count(c.n_groups)
    if tokenizer_folder is not None:
        write_gpt2_vocab(w, tokenizer_folder)
    qtype = gguf.GGMLQuantizationType[weight_type]
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # equal to token_embd: omitted
        hf_name = name.replace(".dt_bias", ".dt_proj.bias")
        base, _, suffix = hf_name.rpartition(".")
        gname = names.get_name(hf_name) or f"{names.get_name(base)}.{suffix}"
        arr = t.float()
        if name.endswith(".A_log"):
            arr = -torch.exp(arr)
        if name.endswith("conv1d.weight"):
            arr = arr.squeeze(1)
        elif arch == "mamba2" and name.endswith((".A_log", ".D")):
            arr = arr.reshape(-1, 1)
        elif arch == "mamba2" and name.endswith("mixer.norm.weight"):
            arr = arr.reshape(c.n_groups, -1)
        arr = arr.contiguous().numpy()
        matrix = gname.endswith(".weight") and arr.ndim == 2
        if not matrix or gname.endswith(float_only) or qtype == 0:
            w.add_tensor(gname, arr)
            continue
        if qtype == gguf.GGMLQuantizationType.F16 or arr.shape[1] % 32:  # the fallback: F16
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gpt2_vocab(w, folder: str) -> None:
    """A byte-level BPE tokenizer as llama.cpp's converter stores one (``tokenizer.ggml.model``
    gpt2): tokens by id, added tokens as control (special) or user-defined ones, the merges, BOS/EOS
    ids and the chat template."""
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    added = {t.content: t.special for t in tok.added_tokens_decoder.values()}
    kinds = {True: gguf.TokenType.CONTROL, False: gguf.TokenType.USER_DEFINED}
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([kinds[added[t]] if t in added else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_chat_template(tok.chat_template)


def with_file_matrices(hf, path):
    """A copy of ``hf`` computing with the file's F16 and quantized tensors, read back from the
    file and dequantized by the gguf package (F32 ones are ``hf``'s own)."""
    import gguf

    from llmhal.model_loader.gguf_loader import GGUFFile

    f, ref = GGUFFile(path), copy.deepcopy(hf)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, info in f.tensors.items():
            qtype = gguf.GGMLQuantizationType(info.type_id)
            if qtype == gguf.GGMLQuantizationType.F32:
                continue
            back = torch.from_numpy(gguf.quants.dequantize(f.raw(name).numpy(), qtype))
            hf_name = f.hf_name(name)
            experts, found, part = hf_name.rpartition(".experts.")
            if found:  # transformers' experts: gate and up stacked in one [E, 2I, H] tensor
                target = params[f"{experts}.experts.{EXPERT_PARAM[part]}"]
                rows = {"gate_proj.weight": slice(0, back.shape[1]),
                        "up_proj.weight": slice(back.shape[1], None)}.get(part, slice(None))  # fmt: skip
                target[:, rows].copy_(back)
            else:
                params[hf_name].copy_(back.view_as(params[hf_name]))
    return ref


@pytest.mark.parametrize("arch", ["mamba", "falcon_mamba", "mamba2"])
def test_f32_file_matches_transformers(tiny_models, tmp_path, arch):
    from llmhal import LLM

    folder, hf = tiny_models(arch)
    write_ssm_gguf(hf, tmp_path / "f32.gguf")
    llm = LLM(str(tmp_path / "f32.gguf"), tokenizer=folder, **KW)
    assert type(llm.engine.runner.model).__name__ == hf.config.architectures[0]
    assert llm.engine.runner.attention_backends == [
        "mamba2_attn" if arch == "mamba2" else "mamba1_attn"
    ]
    assert compare_with_references(llm, hf_references(hf, PROMPTS, STEPS)) == []


@pytest.mark.parametrize(
    "arch, weight_type", [("mamba2", "Q8_0"), ("mamba", "F16"), ("falcon_mamba", "Q8_0")]
)
def test_f16_and_q8_0_files_run_their_own_weights(
    tiny_models, tmp_path, monkeypatch, arch, weight_type
):
    """A variant with an untied head (``output.weight``) and, for Mamba-2, biased projections and
    one group; the matrices in F16 or Q8_0."""
    variant = dict(tie_word_embeddings=False)
    if arch == "mamba2":
        variant.update(use_bias=True, n_groups=1)
    folder, hf = tiny_models(arch, **variant)
    path = tmp_path / f"{weight_type}.gguf"
    write_ssm_gguf(hf, path, weight_type)
    check_file_runs_its_weights(hf, path, folder, weight_type, monkeypatch)


@pytest.mark.parametrize("weight_type", ["F16", "Q8_0"])
def test_lfm2_file_runs_its_own_weights(tiny_models, tmp_path, monkeypatch, weight_type):
    """LFM2 (llama.cpp's lfm2, written by test_lfm2's converter copy) held to the same bar: its
    F32 file is compared with transformers there, its F16 and Q8_0 files here."""
    from tests.models.test_lfm2 import write_lfm2_gguf

    folder, hf = tiny_models("lfm2")
    path = tmp_path / f"{weight_type}.gguf"
    write_lfm2_gguf(hf, path, weight_type)
    check_file_runs_its_weights(hf, path, folder, weight_type, monkeypatch)


def write_lfm2_moe_gguf(hf, path, weight_type: str) -> None:
    """LFM2-MoE as llama.cpp's converter writes it (``lfm2moe``): LFM2's layout and metadata, the
    experts stacked per projection (``ffn_gate_exps`` from w1, ``ffn_up_exps`` from w3,
    ``ffn_down_exps`` from w2), the choice bias as ``exp_probs_b.bias``, sigmoid gating, the router
    in F32."""
    import gguf

    c = hf.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2MOE, c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "lfm2moe")
    kv_heads = [0 if t == "conv" else c.num_key_value_heads for t in c.layer_types]
    metadata = {
        "context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
        "block_count": c.num_hidden_layers, "feed_forward_length": c.intermediate_size,
        "head_count": c.num_attention_heads, "head_count_kv": kv_heads,
        "layer_norm_rms_eps": c.norm_eps, "rope_freq_base": c.rope_parameters["rope_theta"],
        "vocab_size": c.vocab_size, "shortconv_l_cache": c.conv_L_cache,
        "expert_count": c.num_experts, "expert_used_count": c.num_experts_per_tok,
        "expert_feed_forward_length": c.moe_intermediate_size,
        "leading_dense_block_count": c.num_dense_layers,
        "expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID,
    }  # fmt: skip
    for key, value in metadata.items():  # the writer's add_<key> methods
        getattr(w, f"add_{key}")(value)
    qtype = gguf.GGMLQuantizationType[weight_type]

    def put(gname: str, arr: np.ndarray, quantize: bool) -> None:
        if quantize and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, arr)

    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        arr = (t.squeeze(1) if name.endswith("conv.conv.weight") else t).float().numpy()
        prefix, _, leaf = name.rpartition(".")
        if name.endswith(".experts.gate_up_proj"):
            blk = f"blk.{name.split('.')[2]}"
            half = arr.shape[1] // 2
            put(f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(arr[:, :half]), True)
            put(f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(arr[:, half:]), True)
        elif name.endswith(".experts.down_proj"):
            put(f"blk.{name.split('.')[2]}.ffn_down_exps.weight", arr, True)
        elif leaf == "expert_bias":
            put(f"{names.get_name(name)}.bias", arr, False)
        else:
            gname = f"{names.get_name(prefix)}.{leaf}"
            router = gname.endswith("ffn_gate_inp.weight")
            put(gname, arr, arr.ndim == 2 and arr.shape[1] % 32 == 0 and not router)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_lfm2_moe_file_matches_transformers(tiny_models, tmp_path, monkeypatch):
    """LFM2-MoE (``lfm2moe``) with a random choice bias: the F32 file equals transformers, the
    Q8_0 one (experts through the GGUF MoE method) transformers on the file's matrices."""
    from llmhal import LLM

    folder, hf = tiny_models("lfm2_moe", routed_scaling_factor=1.0, norm_topk_prob=True)
    torch.manual_seed(1)
    for layer in hf.model.layers[1:]:
        layer.feed_forward.expert_bias.uniform_(-0.5, 0.5)
    write_lfm2_moe_gguf(hf, tmp_path / "f32.gguf", "F32")
    llm = LLM(str(tmp_path / "f32.gguf"), tokenizer=folder, **KW)
    assert compare_with_references(llm, hf_references(hf, PROMPTS, STEPS)) == []
    write_lfm2_moe_gguf(hf, tmp_path / "q8.gguf", "Q8_0")
    check_file_runs_its_weights(hf, tmp_path / "q8.gguf", folder, "Q8_0", monkeypatch)


def check_file_runs_its_weights(hf, path, folder, weight_type, monkeypatch) -> None:
    """Greedy tokens and log-probabilities of the file in ``LLM`` equal transformers' with the
    file's matrices: within 2e-4 for F16 and for Q8_0 dequantized exactly; within 1e-3 for Q8_0
    through the platform's GGUF kernels (5e-4 measured)."""
    from llmhal import LLM

    refs = hf_references(with_file_matrices(hf, path), PROMPTS, STEPS)
    llm = LLM(str(path), tokenizer=folder, **KW)
    quantized = repr(llm.engine.config.quant_config)
    assert weight_type in quantized if weight_type != "F16" else "Q8_0" not in quantized
    assert compare_with_references(llm, refs, atol=2e-4 if weight_type == "F16" else 1e-3) == []
    if weight_type == "Q8_0":
        monkeypatch.setenv("LLMHAL_GGUF_KERNEL", "dequant")
        assert compare_with_references(LLM(str(path), tokenizer=folder, **KW), refs) == []


@pytest.mark.parametrize("arch", ["mamba", "falcon_mamba", "mamba2"])
def test_config_from_metadata_equals_the_checkpoints(tiny_models, tmp_path, arch):
    from llmhal.model_loader.gguf_loader import GGUFFile

    folder, hf = tiny_models(arch)
    write_ssm_gguf(hf, tmp_path / "m.gguf")
    got = GGUFFile(tmp_path / "m.gguf").hf_config()
    want = hf.config
    assert type(got).__name__ == type(want).__name__
    fields = ["hidden_size", "num_hidden_layers", "state_size", "conv_kernel", "expand",
              "layer_norm_epsilon", "use_bias", "use_conv_bias", "vocab_size",
              "tie_word_embeddings", "hidden_act"]  # fmt: skip
    if arch == "mamba2":
        fields += ["num_heads", "head_dim", "n_groups", "time_step_limit"]
    else:
        fields += ["time_step_rank", "intermediate_size"]
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    # The converter's 2**20 context is a placeholder: no position limit comes from the file.
    assert getattr(got, "max_position_embeddings", None) is None


def test_a_file_without_ssm_metadata_names_the_key(tiny_models, tmp_path):
    import gguf

    from llmhal.model_loader.gguf_loader import GGUFFile, GGUFFormatError

    _, hf = tiny_models("mamba2")
    write_ssm_gguf(hf, tmp_path / "m.gguf")
    src = GGUFFile(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "mamba2")
    w.add_embedding_length(hf.config.hidden_size)
    w.add_block_count(hf.config.num_hidden_layers)
    for name in src.tensors:
        w.add_tensor(name, src.raw(name).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFFormatError, match=r"lacks mamba2\.ssm\.inner_size"):
        GGUFFile(tmp_path / "bad.gguf").hf_config()


def test_a_quantized_tensor_llmhal_reads_only_in_float_is_refused(tiny_models, tmp_path):
    from llmhal import LLM
    from llmhal.model_loader.gguf_loader import GGUFFormatError

    folder, hf = tiny_models("mamba2")
    write_ssm_gguf(hf, tmp_path / "m.gguf", "Q8_0", float_only=())  # ssm_norm [2, 64] in Q8_0
    with pytest.raises(GGUFFormatError, match=r"mixer\.norm\.weight is quantized.*F32/F16/BF16"):
        LLM(str(tmp_path / "m.gguf"), tokenizer=folder, **KW)


def test_generate_cli_runs_a_gguf_file_with_its_own_tokenizer(tiny_models, tmp_path, capsys):
    """``llmhal generate --model file.gguf``: the tokenizer comes from the file's vocabulary (as
    llama.cpp's converter stores the checkpoint's), and the greedy tokens are transformers'."""
    from transformers import AutoTokenizer

    from llmhal.entrypoints import generate

    folder, hf = tiny_models("mamba2")
    write_ssm_gguf(hf, tmp_path / "m.gguf", tokenizer_folder=folder)
    args = ["--model", str(tmp_path / "m.gguf"), "--json", "--no-chat", "--max-tokens", "5",
            "--dtype", "float32", "--prompt", "Paris is"]  # fmt: skip
    assert generate.main(args) == 0
    got = json.loads(capsys.readouterr().out.splitlines()[0])["token_ids"]
    prompt = AutoTokenizer.from_pretrained(folder).encode("Paris is")
    (ref,) = hf_references(hf, [prompt], 5)
    assert got == ref.tokens
