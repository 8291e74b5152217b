"""Matching our layer names against the module names a quantized checkpoint's config lists.

Checkpoint configs name the original modules (``q_proj``, ``lm_head``) in skip lists and targets;
our merged layers (``qkv_proj``, ``gate_up_proj``) stand for several of them. A merged layer is
skipped (or gets a scheme) only when all its projections agree; a checkpoint that treats them
differently cannot be served by one merged matmul and is reported as such.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

# Used when the model did not fill QuantizationConfig.packed_modules_mapping.
DEFAULT_PACKED_MODULES: dict[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}

T = TypeVar("T")


def checkpoint_modules(prefix: str, packed: Mapping[str, Sequence[str]] | None = None) -> list[str]:
    """The checkpoint module names our layer ``prefix`` stands for (itself unless merged)."""
    parent, _, last = prefix.rpartition(".")
    mapping = {**DEFAULT_PACKED_MODULES, **(packed or {})}
    if last in mapping:
        return [f"{parent}.{m}" if parent else m for m in mapping[last]]
    return [prefix]


def name_matches(name: str, entry: str) -> bool:
    """True when ``entry`` is ``name`` or a run of its dotted components (``mlp.gate`` matches
    ``model.layers.0.mlp.gate``; ``self_attn`` matches everything under a ``self_attn``)."""
    return f".{entry.strip('.')}." in f".{name}."


def agree(prefix: str, packed: Mapping[str, Sequence[str]] | None, fn: Callable[[str], T]) -> T:
    """``fn`` of every checkpoint module behind ``prefix``; they must all give the same answer."""
    names = checkpoint_modules(prefix, packed)
    answers = [fn(n) for n in names]
    if any(a != answers[0] for a in answers[1:]):
        detail = ", ".join(f"{n}: {a}" for n, a in zip(names, answers, strict=True))
        raise ValueError(
            f"Layer {prefix} merges {len(names)} checkpoint projections that are quantized "
            f"differently ({detail}); llmhal runs them as one matmul, so they must share one "
            "quantization scheme."
        )
    return answers[0]


def is_skipped(
    prefix: str, skip: Sequence[str], packed: Mapping[str, Sequence[str]] | None = None
) -> bool:
    """True when the checkpoint leaves layer ``prefix`` unquantized (listed in ``skip``)."""
    return agree(prefix, packed, lambda n: any(name_matches(n, s) for s in skip))


def quantizes_linear(
    layer: nn.Module,
    prefix: str,
    skip: Sequence[str],
    packed: Mapping[str, Sequence[str]] | None = None,
) -> bool:
    """True when ``layer`` is a linear layer the checkpoint quantizes (not listed in ``skip``): the
    test a method with a plain skip list applies before handing a layer its linear method."""
    from llmhal.layers.linear import LinearBase

    return isinstance(layer, LinearBase) and not is_skipped(prefix, skip, packed)


def kv_cache_scale_name(name: str) -> str | None:
    """Map a checkpoint's KV-cache scale onto llmhal's attention buffer (``<attn>.attn.k_scale``).

    Checkpoints store them as ``self_attn.k_proj.output_scale`` (AutoFP8, older llm-compressor),
    ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale`` (NVIDIA ModelOpt) or ``self_attn.k_scale``
    (newer llm-compressor); None for any other tensor.
    """
    for kind in ("k", "v"):
        for src in (f".{kind}_proj.output_scale", f".{kind}_proj.{kind}_scale"):
            if name.endswith(src):
                return f"{name[: -len(src)]}.attn.{kind}_scale"
    for kind in ("k", "v"):
        src = f".{kind}_scale"
        if name.endswith(src) and not name.endswith(f".attn{src}"):
            return f"{name[: -len(src)]}.attn{src}"
    return None
