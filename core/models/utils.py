"""Pieces the built-in decoder models share: checkpoint-name routing and per-layer options.

Weight loading follows one rule for every model: a checkpoint tensor ``<module>.<param>`` goes to the
parameter ``<param>`` of our module ``<module>``, where a merged module (``qkv_proj``, ``gate_up_proj``)
stands for the checkpoint's separate projections and receives the tensor as one shard. The parameter's
own ``weight_loader(param, tensor, shard_id)`` does the copy, so quantization methods (whose parameters
carry their own loaders and attributes) need nothing model-specific.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmhal.config import get_current_config
from llmhal.layers.vocab_embedding import ParallelLMHead
from llmhal.layers.weights import WeightLoadError, copy_checked


@dataclass(frozen=True)
class StackedParam:
    """Checkpoint module ``source`` (e.g. ``q_proj``) is shard ``shard_id`` of our ``target``."""

    target: str
    source: str
    shard_id: Any


LLAMA_STACKED: tuple[StackedParam, ...] = (
    StackedParam("qkv_proj", "q_proj", "q"),
    StackedParam("qkv_proj", "k_proj", "k"),
    StackedParam("qkv_proj", "v_proj", "v"),
    StackedParam("gate_up_proj", "gate_proj", 0),
    StackedParam("gate_up_proj", "up_proj", 1),
)


def packed_mapping(stacked: Sequence[StackedParam]) -> dict[str, list[str]]:
    """Merged module -> the checkpoint modules it stands for (``QuantizationConfig`` needs it to
    match skip lists and per-module schemes against merged layers)."""
    out: dict[str, list[str]] = {}
    for sp in stacked:
        out.setdefault(sp.target, []).append(sp.source)
    return out


def offer_packed_mapping(mapping: dict[str, list[str]]) -> None:
    """Give the engine's quantization config (if any, and if it has none yet) the model's merged
    modules: quantization schemes name the checkpoint's modules, and our merged ones stand for
    them."""
    quant_config = get_current_config().quant_config
    if quant_config is not None and not getattr(quant_config, "packed_modules_mapping", None):
        quant_config.packed_modules_mapping = {k: list(v) for k, v in mapping.items()}


def output_head(hf_config: Any, embed_tokens: nn.Module, prefix: str) -> tuple[bool, nn.Module]:
    """(whether the config ties the output head to the input embedding, the head): the embedding
    itself when tied, else a new :class:`ParallelLMHead` named ``prefix``."""
    if getattr(hf_config, "tie_word_embeddings", False):
        return True, embed_tokens
    return False, ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, prefix=prefix)


# Checkpoint tensors that are derived state, never weights.
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a whole tensor, checking its shape (dtype converted unless ``param`` is raw bytes)."""
    if shard_id is not None:
        raise WeightLoadError(f"parameter has no shards but shard {shard_id!r} was given")
    copy_checked(param.data, loaded, "weight")


def load_weights_by_name(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    stacked: Sequence[StackedParam] = LLAMA_STACKED,
    ignored_prefixes: Sequence[str] = (),
) -> set[str]:
    """Route HF-named checkpoint tensors into ``model``; returns the names of the loaded parameters.

    ``ignored_prefixes``: checkpoint names to skip (``lm_head.`` when embeddings are tied). Unknown
    names and shape mismatches raise :class:`WeightLoadError` naming the checkpoint tensor. When a
    quantization config is active, its ``get_cache_scale`` maps KV-cache scales onto the attention
    layers' buffers. (Its ``map_checkpoint_weights`` is the loader's job: the stream arrives mapped.)
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    quant_config = _current_quant_config()
    loaded: set[str] = set()
    shards: dict[str, set[Any]] = {}
    for name, tensor in weights:
        if name.endswith(SKIPPED_SUFFIXES) or name.startswith(tuple(ignored_prefixes)):
            continue
        scale_name = quant_config.get_cache_scale(name) if quant_config is not None else None
        if scale_name is not None:
            _load_buffer(buffers, scale_name, name, tensor)
            loaded.add(scale_name)
            continue
        target, shard_id = _route(name, stacked)
        param = params.get(target)
        if param is None:
            raise WeightLoadError(_unknown_message(name, target, params))
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except WeightLoadError as e:
            raise WeightLoadError(f"checkpoint tensor {name!r} -> {target}: {e}") from None
        loaded.add(target)
        if shard_id is not None:
            shards.setdefault(target, set()).add(shard_id)
    _check_shards(shards, stacked)
    return loaded


def _current_quant_config() -> Any:
    from llmhal.config import get_current_config

    try:
        return get_current_config().quant_config
    except RuntimeError:
        return None


def _route(name: str, stacked: Sequence[StackedParam]) -> tuple[str, Any]:
    parts = name.split(".")
    for sp in stacked:
        # Match a whole dotted component, so "k_proj" never matches inside "qk_proj".
        if sp.source in parts[:-1]:
            i = len(parts) - 2 - parts[-2::-1].index(sp.source)
            return ".".join([*parts[:i], sp.target, *parts[i + 1 :]]), sp.shard_id
    return name, None


def _unknown_message(name: str, target: str, params: dict[str, torch.Tensor]) -> str:
    # Describe the deepest module of the path that exists, so a renamed or extra tensor is easy
    # to place ("self_attn has attn, o_proj, qkv_proj").
    parts = target.split(".")[:-1]
    while parts:
        module = ".".join(parts)
        children = sorted(
            {n[len(module) + 1 :].split(".")[0] for n in params if n.startswith(module + ".")}
        )
        if children:
            where = f"{module!r} has {', '.join(children)}"
            break
        parts.pop()
    else:
        where = "the model has none of its modules"
    routed = f" (routed to {target!r})" if target != name else ""
    return (
        f"checkpoint tensor {name!r}{routed} does not match any parameter of the model: {where}. "
        "The checkpoint may be for another architecture or quantization method."
    )


def _load_buffer(buffers: dict[str, torch.Tensor], target: str, name: str, t: torch.Tensor) -> None:
    buf = buffers.get(target)
    if buf is None:
        raise WeightLoadError(f"checkpoint tensor {name!r} -> {target}: no such buffer")
    if t.numel() != 1:
        raise WeightLoadError(
            f"checkpoint tensor {name!r}: a KV-cache scale must be a scalar, got shape {tuple(t.shape)}"
        )
    buf.fill_(float(t.reshape(())))


def _check_shards(shards: dict[str, set[Any]], stacked: Sequence[StackedParam]) -> None:
    expected: dict[str, list[StackedParam]] = {}
    for sp in stacked:
        expected.setdefault(sp.target, []).append(sp)
    for target, got in shards.items():
        parent, module, param = _split_param(target)
        missing = [sp for sp in expected.get(module, []) if sp.shard_id not in got]
        if missing:
            # Name the tensors as the checkpoint does (q_proj.weight_scale), which is what a
            # user searches the files for, then how they merge.
            names = ", ".join(f"{parent}{sp.source}.{param}" for sp in missing)
            raise WeightLoadError(
                f"the checkpoint has no {names}: {target} merges "
                f"{', '.join(sp.source for sp in expected[module])} and the checkpoint has shards "
                f"{sorted(map(str, got))} but not {[str(sp.shard_id) for sp in missing]}"
            )


def _split_param(target: str) -> tuple[str, str, str]:
    """``"a.b.qkv_proj.weight"`` -> (``"a.b."``, ``"qkv_proj"``, ``"weight"``)."""
    path, _, param = target.rpartition(".")
    parent, _, module = path.rpartition(".")
    return (parent + "." if parent else ""), module, param


def missing_parameters(model: nn.Module, loaded: set[str]) -> list[str]:
    """Parameters of ``model`` that ``loaded`` (from ``load_weights``) does not cover."""
    return [n for n, _ in model.named_parameters() if n not in loaded]


def layer_sliding_window(hf_config: Any, layer_idx: int) -> int | None:
    """The sliding window of decoder layer ``layer_idx`` (None = full attention).

    ``layer_types`` (transformers 5) decides when present; otherwise Qwen-style configs use the
    window from layer ``max_window_layers`` on when ``use_sliding_window`` is set, and Mistral-style
    configs use ``sliding_window`` on every layer.
    """
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    types = getattr(hf_config, "layer_types", None)
    if types:
        return int(window) if types[layer_idx] == "sliding_attention" else None
    first = getattr(hf_config, "max_window_layers", None)
    if first is not None and layer_idx < first:
        return None
    return int(window)
