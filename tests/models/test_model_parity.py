"""Built-in architectures against HF transformers on tiny random checkpoints (fp32).

Each case saves a tiny HF model with ``save_pretrained``, loads it through the safetensors loader into
our class, prefills four prompts of different lengths (1 to 23 tokens) in ONE varlen step over a
paged KV cache, then decodes 12 greedy steps batched. Every logit row must be within 1e-4 of the
logit scale of HF's forward on the same tokens, and the tokens must equal HF ``generate``.
"""

from __future__ import annotations

import pytest
import torch

from llmhal.testing.model_parity import check_parity, save_tiny_model, saved_once, tiny_config

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES = {
    "llama-tied": ("LlamaForCausalLM", {"tied": True}),
    "llama-untied-bias-llama3rope": (
        "LlamaForCausalLM",
        {"attention_bias": True, "mlp_bias": True, "rope_parameters": LLAMA3_ROPE},
    ),
    "mistral-sliding4": ("MistralForCausalLM", {"sliding_window": 4}),
    "qwen2-tied-sliding": (
        "Qwen2ForCausalLM",
        {"tied": True, "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    ),
    "qwen3-untied-headdim32": ("Qwen3ForCausalLM", {"head_dim": 32}),
    "qwen3-tied-bias": ("Qwen3ForCausalLM", {"tied": True, "attention_bias": True}),
}

BACKENDS = ["reference", "cpu_attn"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One saved checkpoint (and its HF model) per case, shared by the backends."""

    def save(case: str, folder):
        arch, kw = CASES[case]
        return save_tiny_model(tiny_config(arch, **kw), folder), folder

    return saved_once(tmp_path_factory, save)


def _skip_unless_usable(backend: str) -> None:
    from llmhal.attention.backend import AttentionRequirements
    from llmhal.attention.registry import get_backend_entry
    from llmhal.attention.selector import backend_reasons
    from llmhal.platforms import get_current_platform

    entry = get_backend_entry(backend)
    if entry is None:
        pytest.skip(f"attention backend {backend!r} is not installed")
    req = AttentionRequirements(head_size=16, num_heads=4, num_kv_heads=2, dtype=torch.float32)
    reasons = backend_reasons(entry, req, get_current_platform())
    if reasons:
        pytest.skip(f"{backend} unusable here: {'; '.join(reasons)}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf_fp32(case, backend, checkpoints):
    _skip_unless_usable(backend)
    hf, folder = checkpoints(case)
    report = check_parity(hf, folder, attention_backend=backend, rel_tol=1e-4)
    assert report.backends == [backend]
    report.raise_on_failure()


def test_bf16_logits_close_to_hf_fp32(checkpoints):
    """bf16 weights and activations: logits within bf16 accuracy of the fp32 HF model (tokens
    may legitimately flip on near-ties, so only logits are compared)."""
    hf, folder = checkpoints("qwen3-tied-bias")
    report = check_parity(
        hf, folder, dtype=torch.bfloat16, rel_tol=3e-2, compare_tokens=False, decode_steps=6
    )
    report.raise_on_failure()
    assert report.max_rel_diff > 0  # it really ran in bf16


def test_sliding_windows_are_wired_per_layer(checkpoints):
    """The window reaches each attention layer as HF applies it, and it matters for these prompts
    (so the parity cases above would catch a missing window)."""
    from llmhal.attention.layer import Attention
    from llmhal.testing.model_parity import build_model

    expected = {
        "mistral-sliding4": [4, 4, 4],
        "qwen2-tied-sliding": [None, 5, 5],  # layers from max_window_layers on
        "llama-tied": [None, None, None],
    }
    for case, windows in expected.items():
        hf, folder = checkpoints(case)
        model, _ = build_model(folder, attention_backend="reference")
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        assert [layer.requirements.sliding_window for layer in layers] == windows, case
    hf, _ = checkpoints("mistral-sliding4")
    ids = torch.arange(3, 26)[None]
    with torch.no_grad():
        windowed = hf(ids).logits
        hf.config.sliding_window = None
        try:
            full = hf(ids).logits
        finally:
            hf.config.sliding_window = 4
    assert (windowed - full).abs().max() > 1e-2
