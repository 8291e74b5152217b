"""Model-level checks for quantization methods: a tiny Llama quantized with the method's reference
tool, run through :class:`llmhal.LLM`, against the same model with the weights dequantized by that
reference and run unquantized.

A test supplies ``quantize(name, weight) -> (tensors, dequantized weight)`` for the decoder's
linear layers (``q_proj`` ... ``down_proj``); :func:`write_pair` writes both checkpoints and
:func:`assert_greedy_parity` compares greedy tokens (identical) and top log-probabilities (within a
stated tolerance)::

    quant, ref = write_pair(tmp_path, quantize, {"quant_method": "fp8", ...})
    assert_greedy_parity(quant, ref, logprob_atol=1e-3)
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LINEAR_SUFFIXES = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
    "gate_proj.weight", "up_proj.weight", "down_proj.weight",
)  # fmt: skip
# A MoE checkpoint's expert projections besides those (Mixtral's spelling; the router ``gate``
# is not among them).
EXPERT_SUFFIXES = ("w1.weight", "w2.weight", "w3.weight")
PROMPTS = [[5, 17, 42], [7, 100, 23, 9, 88, 64, 3, 250, 31], [300, 12]]
KV_CACHE_BYTES = 4 << 20

Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def tiny_llama(folder: Path, **overrides: Any) -> Path:
    """A tiny random Llama checkpoint (fp32) in ``folder``; wider than the engine tests' default so
    that group sizes up to 128 divide every input dimension."""
    from llmhal.testing.tiny_models import make_tiny_model

    shape = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
             "num_key_value_heads": 2, "tie_word_embeddings": True}  # fmt: skip
    make_tiny_model(folder, "llama", **{**shape, **overrides})
    return folder


@functools.cache
def shared_tiny_llama() -> Path:
    """:func:`tiny_llama` built once per process (removed at exit), shared by every test."""
    folder = Path(tempfile.mkdtemp(prefix="llmhal_tiny_llama_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return tiny_llama(folder / "base")


def write_pair(
    folder: Path,
    quantize: Quantizer,
    quantization_config: dict[str, Any] | None,
    *,
    base: Path | None = None,
    suffixes: tuple[str, ...] = LINEAR_SUFFIXES,
) -> tuple[Path, Path]:
    """Write ``folder/quantized`` and ``folder/reference`` from the tiny Llama in ``base`` (default:
    :func:`shared_tiny_llama`), quantizing the tensors whose names end with one of ``suffixes``."""
    from safetensors.torch import load_file, save_file

    base = base or shared_tiny_llama()
    state = load_file(str(base / "model.safetensors"))
    quant, ref = {}, {}
    for name, tensor in state.items():
        if name.endswith(suffixes):
            module = name.removesuffix(".weight")
            tensors, deq = quantize(name, tensor)
            quant.update({f"{module}.{k}": v.contiguous() for k, v in tensors.items()})
            ref[name] = deq.to(torch.float32).contiguous()
        else:
            quant[name] = ref[name] = tensor
    out = []
    # quantization_config None: the "quantized" folder stays a plain checkpoint (online methods).
    for sub, tensors, qcfg in (("quantized", quant, quantization_config), ("reference", ref, None)):
        target = folder / sub
        shutil.copytree(base, target, dirs_exist_ok=True)
        save_file(tensors, str(target / "model.safetensors"))
        cfg = json.loads((target / "config.json").read_text())
        if qcfg is not None:
            cfg["quantization_config"] = qcfg
        (target / "config.json").write_text(json.dumps(cfg, indent=2))
        out.append(target)
    return out[0], out[1]


def assert_greedy_parity(
    quantized: Path,
    reference: Path,
    *,
    logprob_atol: float,
    new_tokens: int = 12,
    dtype: str = "float32",
    **llm_kwargs: Any,
) -> Any:
    """Greedy tokens identical; every top-5 log-probability within ``logprob_atol``. Returns the
    two engines' load reports (quantized, reference)."""
    from llmhal import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    kv = {"kv_cache_memory_bytes": KV_CACHE_BYTES}
    q_llm = LLM(str(quantized), dtype=dtype, **kv, **llm_kwargs)
    got = q_llm.generate(prompts, params)
    ref_llm = LLM(str(reference), dtype=dtype, **kv)
    want = ref_llm.generate(prompts, params)
    for prompt, g, w in zip(PROMPTS, got, want, strict=True):
        g0, w0 = g.outputs[0], w.outputs[0]
        assert g0.token_ids == w0.token_ids, f"prompt {prompt}: {g0.token_ids} != {w0.token_ids}"
        for step, (ge, we) in enumerate(zip(g0.logprobs, w0.logprobs, strict=True)):
            for tok, lp in we.items():
                if tok in ge:
                    diff = abs(ge[tok].logprob - lp.logprob)
                    assert diff < logprob_atol, (prompt, step, tok, ge[tok], lp)
    return q_llm.load_report, ref_llm.load_report


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble of an AWQ word holds


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[R, C] values in [0, 15] -> [R, C/8] int32 words, AWQ's interleaved nibble order."""
    v = values.to(torch.int64).reshape(values.shape[0], -1, 8)
    word = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        word |= v[:, :, col] << (4 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def awq_rtn(w: torch.Tensor, g: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Asymmetric round-to-nearest in AWQ's stored form (AWQ's scale search left out)."""
    n, k = w.shape
    v = w.view(n, k // g, g)
    lo, hi = v.amin(-1).clamp(max=0), v.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-8).to(torch.float16)  # [N, K/g]
    zeros = torch.round(-lo / scales.float()).long()
    q = torch.clamp(torch.round(v / scales.float()[..., None]) + zeros[..., None], 0, 15).long()
    deq = ((q - zeros[..., None]).double() * scales.double()[..., None]).view(n, k)
    tensors = {
        "qweight": awq_pack(q.view(n, k).T),
        "qzeros": awq_pack(zeros.T),
        "scales": scales.T.contiguous(),
    }
    return tensors, deq
