"""Tiny random models built from a config, for tests (no download, seconds to build).

``make_tiny_model(folder, arch)`` writes a transformers checkpoint (config.json, safetensors, a small
byte-level BPE tokenizer with a chat template) and returns the HF model, so a test can compare llmhal
against transformers on the very same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_VOCAB = 384
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Unicode: café, naïve, Ångström, 東京, 北京, 😀, 🚀, Ελληνικά, русский.",
    "def f(x):\n    return x * 2\n",
]

ARCHS = ("llama", "llama_untied", "mistral", "qwen2", "qwen3")
# Models with recurrent layers (state cache): their configs differ from the Llama family's.
STATE_ARCHS = ("lfm2", "lfm2_moe", "minimax", "bamba")
# Pure state-space models (no attention layer at all).
MAMBA_ARCHS = ("mamba", "falcon_mamba", "mamba2")


def make_tokenizer(vocab_size: int = TINY_VOCAB) -> Any:
    """A byte-level BPE tokenizer trained on a tiny corpus (multi-byte characters included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: str, vocab_size: int = TINY_VOCAB, **overrides: Any) -> Any:
    """A small transformers config of ``arch`` (one of :data:`ARCHS`)."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,  # peaked logits: greedy parity is not decided by rounding noise
        bos_token_id=1,
        eos_token_id=0,
        tie_word_embeddings=True,
    )
    if arch in ("llama", "llama_untied"):
        cls = transformers.LlamaConfig
        common["tie_word_embeddings"] = arch == "llama"
    elif arch == "mistral":
        cls = transformers.MistralConfig
        common.update(sliding_window=8, tie_word_embeddings=False)
    elif arch == "qwen2":
        cls = transformers.Qwen2Config
    elif arch == "qwen3":
        cls = transformers.Qwen3Config
        common.update(head_dim=16)
    elif arch in STATE_ARCHS:
        cls, extra = _state_arch_config(arch)
        common.update(extra)
    elif arch in MAMBA_ARCHS:
        cls, extra = _mamba_config(arch)
        common.update(extra)
    else:
        known = ", ".join(ARCHS + STATE_ARCHS + MAMBA_ARCHS)
        raise ValueError(f"unknown tiny arch {arch!r}; known: {known}")
    common.update(overrides)
    return cls(**common)


def _state_arch_config(arch: str) -> tuple[Any, dict[str, Any]]:
    """Config class and settings of the hybrid tiny models: 3 layers, the middle one softmax
    attention, the others recurrent (short convolution, lightning attention, Mamba-2)."""
    import transformers

    if arch == "lfm2":  # intermediate_size used as given (no 2/3 adjustment)
        extra = dict(full_attn_idxs=[1], block_auto_adjust_ff_dim=False, conv_L_cache=3)
        return transformers.Lfm2Config, dict(num_hidden_layers=3, **extra)
    if arch == "lfm2_moe":  # a dense first layer, then 4 experts of 32 (top 2, sigmoid)
        types = ["conv", "full_attention", "conv"]
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        extra = dict(num_dense_layers=1, layer_types=types, **moe)
        return transformers.Lfm2MoeConfig, dict(num_hidden_layers=3, **extra)
    if arch == "minimax":  # 16-token lightning blocks: a prompt of 17+ crosses a block boundary
        types = ["linear_attention", "full_attention", "linear_attention"]
        moe = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)
        return transformers.MiniMaxConfig, dict(
            num_hidden_layers=3,
            head_dim=16,
            layer_types=types,
            block_size=16,
            tie_word_embeddings=False,
            **moe,
        )
    # bamba: 8 Mamba-2 heads of 16 (expand 2), 16-token SSD chunks
    mamba = dict(mamba_n_heads=8, mamba_d_state=16, mamba_chunk_size=16, mamba_d_conv=4)
    extra = dict(num_hidden_layers=3, attn_layer_indices=[1], tie_word_embeddings=False)
    return transformers.BambaConfig, dict(**extra, **mamba)


def _mamba_config(arch: str) -> tuple[Any, dict[str, Any]]:
    """Mamba-1 / FalconMamba / Mamba-2 settings: 2 layers of width 64, inner width 128, 16 state
    channels; Mamba-2 with 8 heads of 16 in 2 groups and 16-token SSD chunks (a 17+ token prompt
    crosses a chunk)."""
    import transformers

    if arch == "mamba2":
        extra = dict(num_heads=8, head_dim=16, n_groups=2, state_size=16, chunk_size=16)
        return transformers.Mamba2Config, dict(expand=2, conv_kernel=4, **extra)
    cls = transformers.FalconMambaConfig if arch == "falcon_mamba" else transformers.MambaConfig
    return cls, dict(expand=2, conv_kernel=4, state_size=16, time_step_rank=8)


def make_tiny_model(
    folder: str | Path, arch: str = "llama", seed: int = 0, **overrides: Any
) -> Any:
    """Build, save (fp32 safetensors + tokenizer) and return a random HF causal LM."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    make_tokenizer(config.vocab_size).save_pretrained(folder)
    return model
