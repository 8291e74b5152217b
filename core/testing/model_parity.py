"""Model parity kit: llmhal's model classes against HF transformers on tiny random checkpoints.

A test builds a tiny HF model from a config, saves it with ``save_pretrained``, loads it into the
llmhal class registered for its architecture (through the safetensors loader and ``load_weights``),
and runs it step by step over a paged KV cache exactly as the engine does: one flattened varlen
prefill of several prompts, then batched decode steps, with metadata from
:func:`llmhal.attention.batch.build_common_metadata` and each layer's own backend. Platform packages
reuse it to check their attention backends and op kernels end to end (pass ``device``)::

    hf = save_tiny_model(tiny_config("LlamaForCausalLM"), tmp_path)
    report = check_parity(hf, tmp_path, attention_backend="reference", device="cpu")
    report.raise_on_failure()
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# The tiny shapes: GQA (4 query heads over 2 KV heads), 3 layers, a vocabulary of 256.
TINY_BASE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def tiny_config(arch: str, *, tied: bool = False, **overrides: Any) -> Any:
    """A transformers config of a tiny random model of architecture ``arch``."""
    import transformers

    name = arch.removesuffix("ForCausalLM") + "Config"
    cls = getattr(transformers, name)
    kw = {**TINY_BASE, "tie_word_embeddings": tied, **overrides}
    cfg = cls(**kw)
    cfg.architectures = [arch]
    return cfg


def save_tiny_model(config: Any, folder: str | Path, *, seed: int = 0) -> Any:
    """Build the HF model for ``config`` with seeded random weights, save it, return it (fp32, eval).

    Norm weights are randomised too (HF initialises them to one), so a wrong norm weight shows.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model = model.float().eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    return model


def saved_once(
    tmp_path_factory: Any, save: Callable[[str, Path], tuple[Any, Any]]
) -> Callable[[str], tuple[Any, Any]]:
    """For a module-scoped fixture: ``get(case)`` returns ``save(case, folder)``'s (HF model,
    checkpoint path), saving each case once into a fresh temporary folder, so that the tests of a
    module share their checkpoints instead of each saving its own."""
    made: dict[str, tuple[Any, Any]] = {}

    def get(case: str) -> tuple[Any, Any]:
        if case not in made:
            made[case] = save(case, tmp_path_factory.mktemp(case))
        return made[case]

    return get


def build_model(
    folder: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    attention_backend: str | None = None,
    block_size: int = 16,
    max_model_len: int | None = None,
    device: str | torch.device = "cpu",
) -> tuple[Any, Any]:
    """Load the checkpoint in ``folder`` into its llmhal model class; returns (model, config)."""
    from transformers import AutoConfig

    from llmhal.config import CacheConfig, EngineConfig, ModelConfig, set_current_config
    from llmhal.engine.builder import process_weights_after_loading
    from llmhal.model_loader.safetensors_loader import iter_safetensors_weights
    from llmhal.models.registry import ModelRegistry
    from llmhal.models.utils import missing_parameters

    hf_config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    cls, arch = ModelRegistry.resolve_model_cls(hf_config.architectures)
    config = EngineConfig(
        model=ModelConfig(
            model=str(folder),
            hf_config=hf_config,
            dtype=dtype,
            architecture=arch,
            max_model_len=max_model_len or hf_config.max_position_embeddings,
        ),
        cache=CacheConfig(block_size=block_size),
        attention_backend=attention_backend,
        device=torch.device(device),
    )
    with set_current_config(config), torch.device(device):
        model = cls(hf_config)
    with set_current_config(config):
        loaded = model.load_weights(iter_safetensors_weights(folder, progress=False))
        missing = missing_parameters(model, loaded)
        if missing:
            raise AssertionError(f"parameters not loaded from the checkpoint: {missing}")
        process_weights_after_loading(model)
    return model.eval(), config


class PagedRunner:
    """Runs steps of a model over a paged KV cache the way the engine's runner does.

    Blocks are handed out in a shuffled order, so block tables are never contiguous.
    """

    def __init__(self, model: Any, config: Any, *, num_blocks: int = 64, seed: int = 0) -> None:
        from llmhal.attention.layer import Attention

        self.model = model
        self.config = config
        self.device = config.device or torch.device("cpu")
        self.block_size = config.cache.block_size
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.builders: dict[str, Any] = {}
        for layer in self.layers:
            name = layer.backend.name
            if name not in self.builders:
                self.builders[name] = layer.backend.get_builder_cls()(
                    layer.requirements, self.device
                )
            cache_dtype = config.cache.kv_cache_dtype
            shape = layer.backend.get_kv_cache_shape(
                num_blocks, self.block_size, layer.num_kv_heads, layer.head_size, cache_dtype
            )
            dtype = layer.backend.kv_cache_torch_dtype(config.model.dtype, cache_dtype)
            layer.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[Any, list[int]] = {}
        self.computed: dict[Any, int] = {}

    @property
    def backends(self) -> list[str]:
        return list(self.builders)

    def step(
        self, items: Sequence[tuple[Any, Sequence[int]]], *, all_logits: bool = False
    ) -> dict[Any, torch.Tensor]:
        """Run one step; ``items`` are (request id, new token ids). Returns per request the
        float32 logits of its last new token ([vocab]), or of every new token with ``all_logits``."""
        from llmhal.attention.batch import build_common_metadata
        from llmhal.forward_context import ForwardContext, set_forward_context

        ordered = sorted(items, key=lambda it: len(it[1]) != 1)  # decodes first, stable
        ids: list[int] = []
        lens, computed, tables = [], [], []
        for rid, toks in ordered:
            start = self.computed.get(rid, 0)
            need = -(-(start + len(toks)) // self.block_size)
            table = self.blocks.setdefault(rid, [])
            while len(table) < need:
                table.append(self.free.pop())
            ids.extend(toks)
            lens.append(len(toks))
            computed.append(start)
            tables.append(list(table))
        common = build_common_metadata(lens, computed, tables, self.block_size, self.device)
        ctx = ForwardContext(common, {n: b.build(common) for n, b in self.builders.items()})
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        with torch.inference_mode(), set_forward_context(ctx):
            hidden = self.model(input_ids, common.positions)
            logits = self.model.compute_logits(hidden)
        out: dict[Any, torch.Tensor] = {}
        offset = 0
        for (rid, _toks), n in zip(ordered, lens, strict=True):
            self.computed[rid] = self.computed.get(rid, 0) + n
            rows = logits[offset : offset + n]
            out[rid] = (rows if all_logits else rows[-1]).float().cpu()
            offset += n
        return out


@dataclass
class ParityReport:
    """What :func:`check_parity` measured; ``failures`` is empty when the model matches HF."""

    max_rel_diff: float = 0.0
    tokens: dict[int, list[int]] = field(default_factory=dict)
    hf_tokens: dict[int, list[int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)

    def raise_on_failure(self) -> None:
        if self.failures:
            raise AssertionError("model parity failed:\n  " + "\n  ".join(self.failures))


def default_prompts(vocab_size: int, lengths: Sequence[int] = (5, 23, 1, 12), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf_model: Any, prompt: Sequence[int], steps: int) -> list[int]:
    """HF ``generate``: exactly ``steps`` greedy tokens after ``prompt``, never stopping at EOS."""
    # Our loop never stops at EOS, so HF must not either. HF fills an unset EOS from the model's
    # defaults, hence an id no token can take.
    gen_config = copy.deepcopy(hf_model.generation_config)
    gen_config.do_sample = False
    gen_config.max_new_tokens = steps
    gen_config.eos_token_id = hf_model.config.vocab_size
    gen_config.pad_token_id = hf_model.config.pad_token_id
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([list(prompt)]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=gen_config,
        )
    return out[0, len(prompt) :].tolist()


def check_parity(
    hf_model: Any,
    folder: str | Path,
    *,
    prompts: Sequence[Sequence[int]] | None = None,
    decode_steps: int = 12,
    dtype: torch.dtype = torch.float32,
    rel_tol: float = 1e-4,
    attention_backend: str | None = None,
    block_size: int = 16,
    device: str | torch.device = "cpu",
    compare_tokens: bool = True,
) -> ParityReport:
    """Load the checkpoint in ``folder`` into our model and :func:`compare_with_hf`."""
    model, config = build_model(
        folder,
        dtype=dtype,
        attention_backend=attention_backend,
        block_size=block_size,
        device=device,
    )
    return compare_with_hf(
        hf_model,
        model,
        config,
        prompts=prompts,
        decode_steps=decode_steps,
        rel_tol=rel_tol,
        compare_tokens=compare_tokens,
    )


def compare_with_hf(
    hf_model: Any,
    model: Any,
    config: Any,
    *,
    prompts: Sequence[Sequence[int]] | None = None,
    decode_steps: int = 12,
    rel_tol: float = 1e-4,
    compare_tokens: bool = True,
) -> ParityReport:
    """Prefill every prompt in ONE varlen step, then ``decode_steps`` batched greedy decode steps;
    compare every logit row with HF's forward over the same tokens and the greedy tokens with HF
    ``generate``. Logit differences are relative to the largest |logit| of the HF row set.

    ``compare_tokens=False`` skips the greedy comparison (16-bit runs, where near-ties may flip a
    token; the logits are still compared on our own tokens)."""
    prompts = [list(p) for p in (prompts or default_prompts(hf_model.config.vocab_size))]
    runner = PagedRunner(model, config)
    report = ParityReport(backends=runner.backends)
    ours: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    first = runner.step(list(enumerate(prompts)), all_logits=True)
    gen: dict[int, list[int]] = {}
    for i, rows in first.items():
        ours[i].append(rows)
        gen[i] = [int(rows[-1].argmax())]
    for _ in range(decode_steps - 1):
        out = runner.step([(i, [gen[i][-1]]) for i in gen])
        for i, row in out.items():
            ours[i].append(row.unsqueeze(0))
            gen[i].append(int(row.argmax()))
    report.tokens = gen
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt + gen[i][:-1]])).logits[0].float()
        mine = torch.cat(ours[i])
        rel = float((mine - ref).abs().max() / ref.abs().max().clamp_min(1.0))
        report.max_rel_diff = max(report.max_rel_diff, rel)
        if rel > rel_tol:
            report.failures.append(
                f"prompt {i} (len {len(prompt)}): logits differ by {rel:.3g} of the logit scale "
                f"(tolerance {rel_tol:g})"
            )
        if compare_tokens:
            report.hf_tokens[i] = hf_greedy(hf_model, prompt, decode_steps)
            if report.hf_tokens[i] != gen[i]:
                report.failures.append(
                    f"prompt {i}: greedy tokens {gen[i]} != HF {report.hf_tokens[i]}"
                )
    return report
