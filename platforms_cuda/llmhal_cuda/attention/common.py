"""Helpers shared by the CUDA attention backends."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmhal.utils.imports import is_available

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from llmhal.attention.backend import AttentionLayerState, CommonAttentionMetadata
    from llmhal.platforms import Platform


def not_installed(module: str, extra: str) -> str:
    """The availability reason for a missing optional library, naming the extra that installs it."""
    return f"{module} is not installed (pip install llmhal-cuda[{extra}])"


def platform_reasons(platform: Platform) -> list[str]:
    """Reasons a CUDA backend cannot run on ``platform`` at all (it must drive NVIDIA GPUs)."""
    from llmhal_cuda.platform import CudaPlatform

    if not isinstance(platform, CudaPlatform):
        return [f"needs the cuda platform (this is the {platform.name} platform)"]
    return []


def any_installed(*modules: str) -> bool:
    return any(is_available(m) for m in modules)


def check_step(common: CommonAttentionMetadata, backend: str) -> None:
    """Refuse steps this family of backends does not define (non-causal, tree verification)."""
    if not common.causal:
        raise ValueError(f"{backend} implements causal (decoder) attention only")
    if common.tree_mask is not None:
        raise ValueError(
            f"{backend} cannot verify draft trees (tree_mask is set); the tree_attn backend serves "
            f"speculative steps"
        )


def store_and_allocate(
    layer: AttentionLayerState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Write the step's keys/values into the paged cache and return a zeroed output for ``query``
    (rows past ``len(slot_mapping)`` are padding and stay zero, as the contract requires)."""
    import torch

    from llmhal.attention.paged_kv import write_kv

    n = slot_mapping.shape[0]
    write_kv(kv_cache, key[:n], value[:n], slot_mapping, layer.k_scale, layer.v_scale)
    return torch.zeros_like(query)


def kv_token_slots(
    block_table: torch.Tensor, seq_lens_cpu: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots of every cached token of every request, requests one after another, and the
    int32 cumulative sequence lengths [num_reqs + 1], both on the block table's device."""
    import torch

    from llmhal.attention.paged_kv import slots_of

    device = block_table.device
    seq = seq_lens_cpu.long()
    cu = torch.zeros(seq.numel() + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(seq, 0)
    req = torch.repeat_interleave(torch.arange(seq.numel()), seq)
    pos = torch.arange(int(cu[-1])) - cu[:-1][req]
    # Row r of the flattened table starts at r * width, so position p of request r is flat
    # position r * width * block_size + p.
    flat_pos = (req * block_table.shape[1] * block_size + pos).to(device)
    return slots_of(block_table.reshape(-1), flat_pos, block_size), cu.to(device, torch.int32)
