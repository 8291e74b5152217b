"""Loading a model from one GGUF file: HF config, tokenizer, quantization config and weight stream.

:class:`GGUFFile` parses the header (metadata and tensor table) itself, because it is fast: tens of
milliseconds, where the gguf package's ``GGUFReader`` and transformers' GGUF config path (which
builds on it) take seconds on a 49k-token vocabulary. Tensor data is memory-mapped, never read
up front; :meth:`GGUFFile.weights` yields zero-copy views:

* quantized tensors as raw uint8 ``[rows, row_bytes]`` (blocks run along a row, i.e. along K);
* F32/F16/BF16 tensors as float tensors in their own dtype;
* HF names (``model.layers.0.self_attn.q_proj.weight``), mapped with the gguf package's tensor-name
  map for the file's architecture;
* llama's q/k rows un-permuted: llama.cpp's converter reorders each head's rows for its rotary
  layout, and the inverse reorders whole rows, so it applies to quantized rows as well.

Supported architectures: llama (also Mistral and SmolLM, which llama.cpp writes as llama), qwen2,
qwen3, the mixture-of-experts ones: llama with ``expert_count`` (Mixtral), qwen2moe (with its
shared expert), qwen3moe, deepseek2 (DeepSeek-V2/V3, :mod:`llmhal.model_loader.gguf_deepseek`); lfm2 (short convolutions beside attention: KV heads per layer, 0 on
convolution layers) and lfm2moe (experts after the leading dense layers); and the state-space
models mamba (also FalconMamba) and mamba2, whose differences live in
:mod:`llmhal.model_loader.gguf_ssm`. The MoE files' experts are 3-D tensors (``ffn_gate_exps``
[E, I, H], ...), yielded per expert (``mlp.experts.<e>.gate_proj.weight``, LFM2-MoE's under
``feed_forward``: one expert's raw rows) for the MoE layer (:mod:`llmhal.quantization.gguf_moe`).
The tokenizer (with its chat template) is built by transformers from the file's vocabulary and
merges; the HF config is built here from the metadata.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmhal.model_loader.gguf_deepseek import (
    DEEPSEEK2,
    SPLIT_KV_B,
    deepseek_arch,
    deepseek_config,
    deepseek_names,
    deepseek_shapes,
    kv_b_from_split,
    kv_b_types,
    split_kv_b,
)
from llmhal.model_loader.gguf_ssm import (
    SSM_ARCHITECTURES,
    hf_names,
    ssm_arch,
    ssm_config,
    ssm_shapes,
    to_hf,
)
from llmhal.model_loader.hf_config import config_for
from llmhal.quantization.gguf_dequant import GGMLType, ggml_type

# GGUF architecture -> (transformers model_type, HF architecture)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "lfm2": ("lfm2", "Lfm2ForCausalLM"),
    "lfm2moe": ("lfm2_moe", "Lfm2MoeForCausalLM"),
    **SSM_ARCHITECTURES,
}
_MIXTRAL = ("mixtral", "MixtralForCausalLM")  # a llama file with experts
# MoE tensors by llama.cpp's fixed names (per block) -> HF module below ``model.layers.<i>.``.
_MOE_BLOCK = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_PERMUTED_ARCHS = ("llama",)  # llama.cpp permutes q/k rows only for these
_CONFIG_KEYS = {  # "<arch>.<key>" -> HF config field
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
}
_TOKEN_IDS = {
    "bos_token_id": "bos",
    "eos_token_id": "eos",
    "pad_token_id": "padding",
    "unk_token_id": "unknown",
}
_HF_TOP = ("model.embed_tokens", "model.norm", "lm_head")
_HF_BLOCK = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# LFM2's HF modules (llmhal.models.lfm2): short convolutions and attention with other names.
_LFM2_TOP = ("model.embed_tokens", "model.embedding_norm", "lm_head")
_LFM2_BLOCK = (
    "operator_norm",
    "ffn_norm",
    "conv.conv",
    "conv.in_proj",
    "conv.out_proj",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.out_proj",
    "self_attn.q_layernorm",
    "self_attn.k_layernorm",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a GGUF file llmhal can load; the message names the tensor or key."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the file: ``shape`` in torch order (rows first), data at ``offset``."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int  # from the start of the file
    nbytes: int


@dataclass(frozen=True)
class SkippedArray:
    """A long string array (a vocabulary) left unread in :attr:`GGUFFile.metadata`."""

    count: int

    def __len__(self) -> int:
        return self.count


class _Header:
    """A cursor over the file's bytes (``struct`` on the memory map)."""

    def __init__(self, buf: np.ndarray, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, keep_strings: bool) -> Any:
        if vtype in _FIXED:
            return self.take(_FIXED[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _NP:
                arr = np.frombuffer(self.buf, _NP[etype], count, self.pos)
                self.pos += arr.nbytes
                return arr.tolist() if count <= 1024 else arr
            if etype == _STRING and count > 1024 and not keep_strings:
                # Vocabularies are skipped over, not decoded: transformers builds the tokenizer.
                for _ in range(count):
                    length = self.take("<Q")
                    self.pos += length
                return SkippedArray(count)
            return [self.value(etype, keep_strings) for _ in range(count)]
        raise GGUFFormatError(
            f"{self.path}: unknown metadata value type {vtype} at byte {self.pos}"
        )


class GGUFFile:
    """A GGUF file: metadata, tensor table, and what the engine needs from it (see module doc)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.stat().st_size < 4:
            raise GGUFFormatError(
                f"{self.path} is not a GGUF file (only {self.path.stat().st_size} bytes)"
            )
        self._buf = np.memmap(self.path, dtype=np.uint8, mode="c")  # copy-on-write: never written
        if bytes(self._buf[:4]) != b"GGUF":
            raise GGUFFormatError(f"{self.path} is not a GGUF file (no GGUF magic bytes)")
        try:
            self._read_header()
        except (struct.error, OverflowError, MemoryError, IndexError) as e:
            # The header ends before its own counts say it does: a cut-off copy or download.
            raise GGUFFormatError(
                f"{self.path} is truncated or corrupt: its header cannot be read "
                f"({type(e).__name__}: {e}); copy or download the file again"
            ) from None

    def _read_header(self) -> None:
        h = _Header(self._buf, self.path)
        h.pos = 4
        version, n_tensors, n_kv = h.take("<I"), h.take("<Q"), h.take("<Q")
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {version} is not supported (2, 3)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = h.string()
            self.metadata[key] = h.value(h.take("<I"), keep_strings=False)
        table = []
        for _ in range(n_tensors):
            name = h.string()
            dims = [h.take("<Q") for _ in range(h.take("<I"))]
            table.append((name, tuple(reversed(dims)), h.take("<I"), h.take("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        start = (h.pos + align - 1) // align * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, type_id, offset in table:
            self.tensors[name] = GGUFTensorInfo(
                name, shape, type_id, start + offset, self._nbytes(name, shape, type_id)
            )
            if start + offset + self.tensors[name].nbytes > len(self._buf):
                raise GGUFFormatError(f"{self.path}: tensor {name} runs past the end of the file")
        if "general.architecture" not in self.metadata:
            raise GGUFFormatError(f"{self.path} has no general.architecture")

    def _nbytes(self, name: str, shape: tuple[int, ...], type_id: int) -> int:
        t = self.tensor_type(name, type_id)
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        try:
            return rows * t.row_bytes(shape[-1])
        except ValueError as e:
            raise GGUFFormatError(f"GGUF tensor {name}: {e}") from None

    def tensor_type(self, name: str, type_id: int | None = None) -> GGMLType:
        """The tensor's type; an unsupported one is an error naming the tensor."""
        tid = self.tensors[name].type_id if type_id is None else type_id
        try:
            return ggml_type(tid)
        except ValueError as e:
            raise GGUFFormatError(f"GGUF tensor {name} in {self.path.name}: {e}") from None

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    @property
    def is_moe(self) -> bool:
        return int(self._meta("expert_count", 0) or 0) > 0

    def _arch(self) -> tuple[str, str]:
        if self.architecture == "llama" and self.is_moe:
            return _MIXTRAL
        if self.architecture in SSM_ARCHITECTURES:
            return ssm_arch(self)
        if self.architecture == DEEPSEEK2:
            return deepseek_arch(self)
        if self.architecture not in ARCHITECTURES:
            raise GGUFFormatError(
                f"{self.path.name}: GGUF architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join([*ARCHITECTURES, DEEPSEEK2])} (Mistral files are written "
                "as llama)"
            )
        return ARCHITECTURES[self.architecture]

    def _meta(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    # -- config ---------------------------------------------------------------------------------

    def hf_config(self) -> Any:
        """The config the engine reads (``architectures`` set, so it can pick the model): a plain
        transformers ``PreTrainedConfig``, not the architecture's own class (see
        :func:`llmhal.model_loader.hf_config.config_for`); build ``LlamaConfig(**self.config_dict())``
        for a transformers model."""
        from llmhal.model_loader.hf_config import DEFAULTS

        model_type = self._arch()[0]
        if model_type not in DEFAULTS:  # the MoE ones: transformers' own config class
            from transformers import AutoConfig

            return AutoConfig.for_model(model_type, **self.config_dict())
        return config_for(model_type, self.config_dict())

    def config_dict(self) -> dict[str, Any]:
        model_type, arch_cls = self._arch()
        cfg: dict[str, Any] = {"architectures": [arch_cls]}
        for key, field in _CONFIG_KEYS.items():
            if self._meta(key) is not None:
                cfg[field] = self._meta(key)
        cfg.setdefault("num_key_value_heads", cfg.get("num_attention_heads"))
        head_dim = self._meta("attention.key_length")
        if head_dim is None and model_type == "llama":
            head_dim = self._meta("rope.dimension_count")
        if head_dim is not None:
            cfg["head_dim"] = head_dim
        vocab = self._meta("vocab_size")
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if vocab is None and tokens is not None:
            vocab = len(tokens)
        if vocab is None:
            vocab = self.tensors["token_embd.weight"].shape[0]
        cfg["vocab_size"] = int(vocab)
        cfg["tie_word_embeddings"] = "output.weight" not in self.tensors
        if model_type == "llama":
            cfg["attention_bias"] = "blk.0.attn_q.bias" in self.tensors
        for field, key in _TOKEN_IDS.items():
            tid = self.metadata.get(f"tokenizer.ggml.{key}_token_id")
            if tid is not None:
                cfg[field] = int(tid)
        if self.architecture in SSM_ARCHITECTURES:
            return ssm_config(self, cfg)
        scaling = self._rope_scaling()
        if scaling is not None:
            cfg["rope_scaling"] = scaling
        if self.architecture == DEEPSEEK2:
            return deepseek_config(self, cfg)
        if self.is_moe:
            cfg.update(self._moe_config(model_type))
        if model_type in ("lfm2", "lfm2_moe"):
            cfg.update(self._lfm2_config(cfg))
        return cfg

    def _lfm2_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """llama.cpp's LFM2 metadata: KV heads per layer (0 on convolution layers), the conv
        window ``shortconv.l_cache``, and the MLP width already adjusted."""
        kv = cfg.pop("num_key_value_heads")
        kv = list(kv) if isinstance(kv, (list, tuple)) else [kv] * cfg["num_hidden_layers"]
        return {
            "num_key_value_heads": max(kv),
            "full_attn_idxs": [i for i, n in enumerate(kv) if n],
            "layer_types": ["full_attention" if n else "conv" for n in kv],
            "conv_L_cache": int(self._meta("shortconv.l_cache", 3)),
            "norm_eps": cfg.pop("rms_norm_eps", 1e-5),
            "block_auto_adjust_ff_dim": False,
        }

    def _moe_config(self, model_type: str) -> dict[str, Any]:
        experts, used = int(self._meta("expert_count")), int(self._meta("expert_used_count", 0))
        if not 0 < used <= experts:
            raise GGUFFormatError(
                f"{self.path.name}: expert_used_count {used} is not between 1 and expert_count "
                f"{experts}"
            )
        out: dict[str, Any] = {"num_experts_per_tok": used}
        if model_type == "lfm2_moe":
            return {**out, **self._lfm2_moe_config(experts)}
        if model_type == "mixtral":
            out["num_local_experts"] = experts
            return out
        out["num_experts"] = experts
        out["moe_intermediate_size"] = int(self._meta("expert_feed_forward_length"))
        shared = self._meta("expert_shared_feed_forward_length")
        if shared is not None:
            out["shared_expert_intermediate_size"] = int(shared)
        # llama.cpp renormalises qwen3moe's chosen weights and not qwen2moe's, unless the file
        # says otherwise.
        norm = self._meta("expert_weights_norm")
        out["norm_topk_prob"] = bool(norm) if norm is not None else model_type == "qwen3_moe"
        return out

    def _lfm2_moe_config(self, experts: int) -> dict[str, Any]:
        """LFM2-MoE: sigmoid routing, ``leading_dense_block_count`` dense MLPs first, the choice
        bias ``exp_probs_b``; the chosen weights renormalized and unscaled (transformers'
        Lfm2MoeConfig defaults; llama.cpp's converter stores neither) unless the file says
        otherwise."""
        gating = self._meta("expert_gating_func")
        if gating is not None and int(gating) != 2:
            raise GGUFFormatError(
                f"{self.path.name}: lfm2moe expert_gating_func {gating} is not sigmoid (2), the "
                "only routing LFM2-MoE has"
            )
        dense = int(self._meta("leading_dense_block_count", 0))
        norm, scale = self._meta("expert_weights_norm"), self._meta("expert_weights_scale")
        return {
            "num_experts": experts,
            "moe_intermediate_size": int(self._meta("expert_feed_forward_length")),
            "num_dense_layers": dense,
            "use_expert_bias": f"blk.{dense}.exp_probs_b.bias" in self.tensors,
            "norm_topk_prob": True if norm is None else bool(norm),
            "routed_scaling_factor": 1.0 if scale is None else float(scale),
        }

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self._meta("rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind not in ("linear", "yarn"):
            raise GGUFFormatError(
                f"{self.path.name}: rope scaling {kind!r} is not supported (linear, yarn)"
            )
        out: dict[str, Any] = {
            "rope_type": kind,
            "factor": float(self._meta("rope.scaling.factor")),
        }
        orig = self._meta("rope.scaling.original_context_length")
        if orig is not None:
            out["original_max_position_embeddings"] = int(orig)
        return out

    # -- tokenizer and quantization ---------------------------------------------------------------

    def tokenizer(self) -> Any:
        """The tokenizer from the file's vocabulary, merges, special tokens and chat template."""
        from transformers import PreTrainedTokenizerFast

        # transformers' own error ("stating tokenizer None") names no remedy.
        if self.metadata.get("tokenizer.ggml.model") is None:
            raise ValueError(
                f"{self.path.name} has no tokenizer (no tokenizer.ggml.* metadata); pass "
                f"tokenizer=<a folder with the model's tokenizer files> (CLI: --tokenizer)"
            )
        from llmhal.model_loader import tokenizer_cache

        entry = tokenizer_cache.entry_for(self.path)
        damaged = entry is not None and entry.exists()
        tok = tokenizer_cache.load(entry, self.path.name) if entry is not None else None
        if tok is not None:
            return tok
        tok = PreTrainedTokenizerFast.from_pretrained(
            str(self.path.parent), gguf_file=self.path.name, local_files_only=True
        )
        if entry is not None:
            tokenizer_cache.save(tok, entry, replace=damaged)
        return tok

    def quant_config(self) -> Any:
        """A :class:`~llmhal.quantization.gguf.GGUFConfig`: each weight's type by HF module name."""
        from llmhal.quantization.gguf import GGUFConfig

        self.validate()
        types = {}
        for name, info in self.tensors.items():
            base, _, suffix = name.rpartition(".")
            if suffix == "weight" and len(info.shape) in (2, 3):  # 3-D: a MoE layer's experts
                types[self.name_map[base]] = self.tensor_type(name).type_id
        if self.architecture == DEEPSEEK2 and split_kv_b(self):
            types = kv_b_types(types)
        return GGUFConfig(types, tie_word_embeddings="output.weight" not in self.tensors)

    # -- names, shapes, weights -------------------------------------------------------------------

    @cached_property
    def name_map(self) -> dict[str, str]:
        """GGUF tensor base name (``blk.0.attn_q``) -> HF module name, via gguf's tensor map."""
        import gguf

        self._arch()
        arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == self.architecture)
        n_layers = int(self._meta("block_count", 0))
        gmap = gguf.get_tensor_name_map(arch, n_layers)
        if self.architecture == DEEPSEEK2:
            return deepseek_names(gmap, n_layers)
        top, block = (
            (_LFM2_TOP, _LFM2_BLOCK)
            if self.architecture in ("lfm2", "lfm2moe")
            else (_HF_TOP, _HF_BLOCK)
        )
        hf = [*top, *(f"model.layers.{i}.{m}" for i in range(n_layers) for m in block)]
        if self.architecture in SSM_ARCHITECTURES:
            hf = hf_names(n_layers)
        out = {}
        for name in hf:
            base = gmap.get_name(name)
            if base is not None:
                out[base] = name
        if self.is_moe:
            # LFM2-MoE's MLP is feed_forward; its choice bias is one suffixed tensor.
            ffn = "feed_forward." if self.architecture == "lfm2moe" else "mlp."
            for i in range(n_layers):
                p = f"model.layers.{i}.{ffn}"
                out.update({f"blk.{i}.{g}": p + h.removeprefix("mlp.") for g, h in _MOE_BLOCK.items()})  # fmt: skip
                out[f"blk.{i}.exp_probs_b.bias"] = p + "expert_bias"
        return out

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape the model needs, from the config (``lm_head`` only if untied)."""
        c = self.config_dict()
        if self.architecture in SSM_ARCHITECTURES:
            return ssm_shapes(self.architecture, c)
        if self.architecture == DEEPSEEK2:
            return deepseek_shapes(self, c)
        hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        hd = c.get("head_dim", hidden // heads)
        if self.architecture in ("lfm2", "lfm2moe"):
            return self._lfm2_shapes(c, hd)
        out: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (vocab, hidden),
            "model.norm.weight": (hidden,),
        }
        if not c["tie_word_embeddings"]:
            out["lm_head.weight"] = (vocab, hidden)
        bias = self.architecture in ("qwen2", "qwen2moe") or c.get("attention_bias", False)
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            layer = {
                "input_layernorm.weight": (hidden,),
                "post_attention_layernorm.weight": (hidden,),
                "self_attn.q_proj.weight": (heads * hd, hidden),
                "self_attn.k_proj.weight": (kv * hd, hidden),
                "self_attn.v_proj.weight": (kv * hd, hidden),
                "self_attn.o_proj.weight": (hidden, heads * hd),
                "mlp.gate_proj.weight": (inter, hidden),
                "mlp.up_proj.weight": (inter, hidden),
                "mlp.down_proj.weight": (hidden, inter),
            }
            if bias:
                layer.update({f"self_attn.{x}_proj.bias": (n * hd,) for x, n in (("q", heads), ("k", kv), ("v", kv))})  # fmt: skip
            if self.architecture in ("qwen3", "qwen3moe"):
                layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
            if self.is_moe:
                for dense in ("gate_proj", "up_proj", "down_proj"):
                    del layer[f"mlp.{dense}.weight"]
                layer.update(self._moe_shapes(c, hidden))
            out.update({p + k: v for k, v in layer.items()})
        return out

    def _lfm2_shapes(self, c: dict[str, Any], hd: int) -> dict[str, tuple[int, ...]]:
        hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        out: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (vocab, hidden),
            "model.embedding_norm.weight": (hidden,),
        }
        if not c["tie_word_embeddings"]:
            out["lm_head.weight"] = (vocab, hidden)
        for i, kind in enumerate(c["layer_types"]):
            p = f"model.layers.{i}."
            layer = {
                "operator_norm.weight": (hidden,),
                "ffn_norm.weight": (hidden,),
                "feed_forward.w1.weight": (inter, hidden),
                "feed_forward.w3.weight": (inter, hidden),
                "feed_forward.w2.weight": (hidden, inter),
            }
            if kind == "conv":  # llama.cpp drops nn.Conv1d's unit axis: [hidden, L_cache]
                layer.update({
                    "conv.conv.weight": (hidden, c["conv_L_cache"]),
                    "conv.in_proj.weight": (3 * hidden, hidden),
                    "conv.out_proj.weight": (hidden, hidden),
                })  # fmt: skip
            else:
                layer.update({
                    "self_attn.q_proj.weight": (heads * hd, hidden),
                    "self_attn.k_proj.weight": (kv * hd, hidden),
                    "self_attn.v_proj.weight": (kv * hd, hidden),
                    "self_attn.out_proj.weight": (hidden, heads * hd),
                    "self_attn.q_layernorm.weight": (hd,),
                    "self_attn.k_layernorm.weight": (hd,),
                })  # fmt: skip
            if self.is_moe and i >= c["num_dense_layers"]:  # LFM2-MoE: experts after the dense
                for dense in ("w1", "w2", "w3"):
                    del layer[f"feed_forward.{dense}.weight"]
                moe = self._moe_shapes(c, hidden)
                layer.update({"feed_forward." + k.removeprefix("mlp."): v for k, v in moe.items()})
                if c["use_expert_bias"]:
                    layer["feed_forward.expert_bias"] = (c["num_experts"],)
            out.update({p + k: v for k, v in layer.items()})
        return out

    def _moe_shapes(self, c: dict[str, Any], hidden: int) -> dict[str, tuple[int, ...]]:
        e = c.get("num_local_experts") or c["num_experts"]
        inter = c.get("moe_intermediate_size") or c["intermediate_size"]
        out: dict[str, tuple[int, ...]] = {
            "mlp.gate.weight": (e, hidden),
            "mlp.experts.gate_proj.weight": (e, inter, hidden),
            "mlp.experts.up_proj.weight": (e, inter, hidden),
            "mlp.experts.down_proj.weight": (e, hidden, inter),
        }
        shared = c.get("shared_expert_intermediate_size")
        if shared:
            out.update({
                "mlp.shared_expert_gate.weight": (1, hidden),
                "mlp.shared_expert.gate_proj.weight": (shared, hidden),
                "mlp.shared_expert.up_proj.weight": (shared, hidden),
                "mlp.shared_expert.down_proj.weight": (hidden, shared),
            })  # fmt: skip
        return out

    def hf_name(self, gguf_name: str) -> str:
        """The HF name of a GGUF tensor; unmapped tensors are an error naming them."""
        base, _, suffix = gguf_name.rpartition(".")
        if gguf_name == "rope_freqs.weight":
            raise GGUFFormatError(
                f"{self.path.name}: tensor rope_freqs.weight holds Llama-3-style rope frequency "
                "factors, which llmhal does not apply yet; use a model without them"
            )
        if gguf_name in self.name_map:  # llama.cpp's ssm_a / ssm_d: parameters without a suffix
            return self.name_map[gguf_name]
        if base not in self.name_map:
            raise GGUFFormatError(
                f"{self.path.name}: GGUF tensor {gguf_name} has no counterpart in the "
                f"{self.architecture} model (unmapped tensor)"
            )
        return f"{self.name_map[base]}.{suffix}"

    def validate(self) -> None:
        """Every tensor mapped, of a supported type and the expected shape; none missing."""
        expected = self.expected_shapes()
        seen = set()
        for name, info in self.tensors.items():
            hf = self.hf_name(name)
            self.tensor_type(name)
            if hf not in expected:
                raise GGUFFormatError(
                    f"{self.path.name}: GGUF tensor {name} ({hf}) is not part of the "
                    f"{self.architecture} model described by the file's metadata"
                )
            if tuple(info.shape) != expected[hf] and not _is_shared_gate(hf, info.shape):
                raise GGUFFormatError(
                    f"{self.path.name}: GGUF tensor {name} ({hf}) has shape {info.shape}, the "
                    f"metadata implies {expected[hf]}"
                )
            seen.add(hf)
        missing = sorted(set(expected) - seen)
        if missing:
            raise GGUFFormatError(
                f"{self.path.name} lacks {len(missing)} tensor(s) the {self.architecture} model "
                f"needs: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
            )

    def raw(self, name: str) -> torch.Tensor:
        """Zero-copy view of tensor ``name``: uint8 ``[..., row_bytes]``, or a float tensor."""
        info = self.tensors[name]
        t = self.tensor_type(name)
        data = self._buf[info.offset : info.offset + info.nbytes]
        if t.is_float:
            shape = info.shape
            np_dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}[t.name]
            out = torch.from_numpy(data.view(np_dtype).reshape(shape))
            return out.view(torch.bfloat16) if t.name == "BF16" else out
        return torch.from_numpy(data.reshape(*info.shape[:-1], t.row_bytes(info.shape[-1])))

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` for every tensor, in file order (see the module docstring)."""
        self.validate()
        c = self.config_dict()
        heads = {"q_proj": c.get("num_attention_heads"), "k_proj": c.get("num_key_value_heads")}
        for name in self.tensors:
            hf = self.hf_name(name)
            if self.architecture == DEEPSEEK2 and hf.endswith(SPLIT_KV_B):
                rebuilt = kv_b_from_split(self, hf)  # the two halves of kv_b_proj, put back
                if rebuilt is not None:
                    yield rebuilt
                continue
            tensor = self.raw(name)
            proj = hf.split(".")[-2]
            if self.architecture in _PERMUTED_ARCHS and proj in heads:
                tensor = unpermute_rows(tensor, heads[proj])
            if ".experts." in hf:  # [E, rows, ...]: one expert at a time, as checkpoints do
                module, _, part = hf.rpartition(".experts.")
                for e in range(tensor.shape[0]):
                    yield f"{module}.experts.{e}.{part}", tensor[e]
                continue
            if _is_shared_gate(hf, tuple(tensor.shape)):
                tensor = tensor.reshape(1, -1)  # llama.cpp may store it as a vector
            if self.architecture in SSM_ARCHITECTURES:
                hf, tensor = to_hf(self, hf, tensor)
            yield hf, tensor


def _is_shared_gate(hf_name: str, shape: tuple[int, ...]) -> bool:
    """Qwen2-MoE's shared-expert gate stored as a vector ([H], llama.cpp's shape) or [1, H]."""
    return hf_name.endswith("mlp.shared_expert_gate.weight") and (len(shape) == 1 or shape[0] == 1)


def unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head, rows ``[0::2]`` then ``[1::2]`` become
    the two halves the HF rotary embedding expects. Works on raw quantized rows (whole rows move)."""
    rows = t.shape[0]
    return (
        t.reshape(n_head, rows // n_head // 2, 2, *t.shape[1:])
        .transpose(1, 2)
        .reshape(t.shape)
        .contiguous()
    )
