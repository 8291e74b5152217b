"""GGUF files of the pure state-space models: llama.cpp's ``mamba`` (Mamba-1, and FalconMamba when
``ssm.dt_b_c_rms`` is set) and ``mamba2``.

:class:`~llmhal.model_loader.gguf_loader.GGUFFile` calls in here for the parts that differ from the
attention models: the HF config (from ``ssm.*`` metadata; the converter's ``context_length`` of 2**20,
``head_count`` 0 and ``feed_forward_length`` 0 are placeholders and are dropped), the HF names to map,
the tensor shapes the metadata implies (in the file's layout), and the undoing of llama.cpp's
converter on the tensors it rewrites:

* ``A_log`` is stored as ``A = -exp(A_log)`` (``blk.N.ssm_a``, without a ``.weight`` suffix):
  loaded back as ``log(-A)``; Mamba-2's A and ``D`` carry a trailing unit axis ``[heads, 1]``;
* the depthwise conv weight loses nn.Conv1d's unit axis (``[channels, width]``);
* Mamba-2's ``dt_bias`` is stored as the bias of ``ssm_dt`` (which has no weight there), and its
  gated norm weight as ``[groups, inner / groups]``.

Everything else (quantized matrices, the tied head, the tokenizer) goes through the common GGUF path.
"""

from __future__ import annotations

from typing import Any

import torch

# GGUF architecture -> (transformers model_type, HF architecture)
SSM_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "mamba": ("mamba", "MambaForCausalLM"),
    "mamba2": ("mamba2", "Mamba2ForCausalLM"),
}
_FALCON_MAMBA = ("falcon_mamba", "FalconMambaForCausalLM")  # a mamba file with ssm.dt_b_c_rms
_TOP = ("backbone.embeddings", "backbone.norm_f", "lm_head")
_BLOCK = ("norm", "mixer.in_proj", "mixer.conv1d", "mixer.x_proj", "mixer.dt_proj",
          "mixer.A_log", "mixer.D", "mixer.norm", "mixer.out_proj")  # fmt: skip


def ssm_arch(f: Any) -> tuple[str, str]:
    """(model_type, HF architecture) of a ``mamba``/``mamba2`` file."""
    if f.architecture == "mamba" and f._meta("ssm.dt_b_c_rms"):
        return _FALCON_MAMBA
    return SSM_ARCHITECTURES[f.architecture]


def hf_names(n_layers: int) -> list[str]:
    """The HF module and parameter names gguf's tensor map is asked for (A_log and D are
    parameters: llama.cpp names them ``blk.N.ssm_a`` / ``ssm_d``, with no suffix)."""
    return [*_TOP, *(f"backbone.layers.{i}.{m}" for i in range(n_layers) for m in _BLOCK)]


def need_meta(f: Any, key: str) -> int:
    """A metadata value the file's architecture requires (the GGUF modules share it)."""
    value = f._meta(key)
    if value is None:
        from llmhal.model_loader.gguf_loader import GGUFFormatError

        raise GGUFFormatError(
            f"{f.path.name}: {f.architecture} metadata lacks {f.architecture}.{key} "
            "(not a file written by llama.cpp's converter?)"
        )
    return int(value)


def _f32_decimal(value: float) -> float:
    """The shortest decimal that a float32 metadata value rounds from (1e-5 rather than
    9.99999974e-06): the checkpoint's own value, as its config.json wrote it."""
    import numpy as np

    return float(str(np.float32(value)))


def ssm_config(f: Any, common: dict[str, Any]) -> dict[str, Any]:
    """The HF config fields of a Mamba/Mamba-2 file; ``common`` holds what every GGUF config has
    (architectures, vocab size, tied head, token ids)."""
    from llmhal.model_loader.gguf_loader import GGUFFormatError

    keep = ("architectures", "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id",
            "pad_token_id", "unk_token_id")  # fmt: skip
    cfg = {k: common[k] for k in keep if k in common}
    hidden, inner = need_meta(f, "embedding_length"), need_meta(f, "ssm.inner_size")
    rank = need_meta(f, "ssm.time_step_rank")
    if inner % hidden:
        # llmhal's mixers take the inner width as expand x hidden (llama.cpp's converter asserts
        # expand 2).
        raise GGUFFormatError(
            f"{f.path.name}: ssm.inner_size {inner} is not a multiple of embedding_length {hidden}"
        )
    cfg.update(
        hidden_size=hidden,
        num_hidden_layers=need_meta(f, "block_count"),
        state_size=need_meta(f, "ssm.state_size"),
        conv_kernel=need_meta(f, "ssm.conv_kernel"),
        expand=inner // hidden,
        layer_norm_epsilon=_f32_decimal(f._meta("attention.layer_norm_rms_epsilon", 1e-5)),
        use_bias="blk.0.ssm_in.bias" in f.tensors,
        use_conv_bias="blk.0.ssm_conv1d.bias" in f.tensors,
        hidden_act="silu",
    )
    if f.architecture == "mamba":
        # FalconMamba's weightless dt/B/C norm keeps transformers' mixer_rms_eps (1e-6, the
        # published checkpoints' value); the file has no key for it.
        cfg["time_step_rank"] = rank
        return cfg
    # Mamba-2: llama.cpp's time_step_rank is the head count. The SSD chunk size is not stored;
    # the scan's result does not depend on it, so transformers' default stands.
    if inner % rank:
        raise GGUFFormatError(
            f"{f.path.name}: ssm.inner_size {inner} does not split into ssm.time_step_rank {rank} "
            "heads"
        )
    cfg.update(num_heads=rank, head_dim=inner // rank, n_groups=int(f._meta("ssm.group_count", 1)))
    return cfg


def ssm_shapes(arch: str, c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor name (as the file's names map) -> shape in the file's layout."""
    hidden, vocab, state = c["hidden_size"], c["vocab_size"], c["state_size"]
    inner, k = c["expand"] * hidden, c["conv_kernel"]
    out: dict[str, tuple[int, ...]] = {
        "backbone.embeddings.weight": (vocab, hidden),
        "backbone.norm_f.weight": (hidden,),
    }
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (vocab, hidden)
    if arch == "mamba":
        rank = c["time_step_rank"]
        conv_dim, in_rows = inner, 2 * inner
        layer = {
            "mixer.x_proj.weight": (rank + 2 * state, inner),
            "mixer.dt_proj.weight": (inner, rank),
            "mixer.dt_proj.bias": (inner,),
            "mixer.A_log": (inner, state),
            "mixer.D": (inner,),
        }
    else:
        heads, groups = c["num_heads"], c["n_groups"]
        conv_dim = inner + 2 * groups * state
        in_rows = inner + conv_dim + heads
        layer = {
            "mixer.dt_proj.bias": (heads,),  # dt_bias
            "mixer.A_log": (heads, 1),
            "mixer.D": (heads, 1),
            "mixer.norm.weight": (groups, inner // groups),
        }
    layer.update({
        "norm.weight": (hidden,),
        "mixer.in_proj.weight": (in_rows, hidden),
        "mixer.conv1d.weight": (conv_dim, k),
        "mixer.out_proj.weight": (hidden, inner),
    })  # fmt: skip
    if c["use_conv_bias"]:
        layer["mixer.conv1d.bias"] = (conv_dim,)
    if c["use_bias"]:
        layer.update({"mixer.in_proj.bias": (in_rows,), "mixer.out_proj.bias": (hidden,)})
    for i in range(c["num_hidden_layers"]):
        out.update({f"backbone.layers.{i}.{n}": s for n, s in layer.items()})
    return out


def to_hf(f: Any, name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The checkpoint tensor llama.cpp's converter turned into ``t`` (see the module doc)."""
    reshaped = (".mixer.A_log", ".mixer.D", ".mixer.conv1d.weight", ".mixer.norm.weight")
    if t.dtype == torch.uint8 and name.endswith(reshaped):  # raw quantized rows
        from llmhal.model_loader.gguf_loader import GGUFFormatError

        raise GGUFFormatError(
            f"{f.path.name}: {name} is quantized; llmhal reads it only in float (F32/F16/BF16), "
            "as llama.cpp's converter writes it"
        )
    if name.endswith(".mixer.A_log"):
        t = torch.log(-t.float())  # back through A = -exp(A_log), in float32 (A may be F16)
    elif name.endswith(".mixer.conv1d.weight"):
        t = t.unsqueeze(1)
    if f.architecture == "mamba2":
        if name.endswith((".mixer.A_log", ".mixer.D", ".mixer.norm.weight")):
            t = t.reshape(-1)
        elif name.endswith(".mixer.dt_proj.bias"):
            name = name.removesuffix("dt_proj.bias") + "dt_bias"
    return name, t
