"""Hardware-neutral helpers that attention backends share, in core and in vendor packages.

* step checks: the engine's step description (:class:`~llmhal.attention.backend.CommonAttentionMetadata`)
  may ask for what a backend does not define (non-causal attention, draft-tree verification); the
  builder refuses it at once, with the same words in every backend;
* availability reasons: a backend that drives one platform's devices says so in the same words;
* kernel-library conventions: llmhal's masking semantics (see :mod:`llmhal.attention.backend`) in the
  form FlashAttention-style libraries take them.

Nothing here imports torch or a vendor library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.attention.backend import CommonAttentionMetadata
    from llmhal.platforms import Platform


def check_causal(common: CommonAttentionMetadata, backend: str) -> None:
    """Raise ValueError when the step asks for non-causal attention (``backend`` names the caller)."""
    if not common.causal:
        raise ValueError(
            f"{backend} implements causal (decoder) attention only; the step asks for non-causal "
            f"attention"
        )


def check_no_tree(common: CommonAttentionMetadata, backend: str) -> None:
    """Raise ValueError when the step verifies a draft tree (``tree_mask`` set)."""
    if common.tree_mask is not None:
        raise ValueError(
            f"{backend} cannot verify draft trees (tree_mask is set); the tree_attn backend serves "
            f"speculative steps"
        )


def check_step(common: CommonAttentionMetadata, backend: str) -> None:
    """Refuse the steps a plain causal backend does not define: non-causal, then tree verification."""
    check_causal(common, backend)
    check_no_tree(common, backend)


def platform_mismatch(platform: Platform, required: type[Platform]) -> list[str]:
    """``[]`` when ``platform`` is a ``required``, else the availability reason naming both."""
    if isinstance(platform, required):
        return []
    return [f"needs the {required.name} platform (this is the {platform.name} platform)"]


def require_model_dtype_cache(kv_cache_dtype: str, backend: str, remedy: str) -> None:
    """Raise ValueError for a quantized KV cache in a backend that stores the model dtype only.

    ``remedy`` completes "kv_cache_dtype=... needs ..." (e.g. "the rocm_attn backend").
    """
    if kv_cache_dtype != "auto":
        raise ValueError(
            f"{backend} stores the KV cache in the model dtype; kv_cache_dtype="
            f"{kv_cache_dtype!r} needs {remedy}"
        )


def flash_window_size(sliding_window: int | None) -> tuple[int, int]:
    """A sliding window in FlashAttention's ``window_size=(left, right)`` form.

    llmhal's window ``W`` lets a query at position ``p`` see keys ``p - W < k <= p``: ``W - 1`` keys
    to the left and none to the right, ``(W - 1, 0)``. No window is ``(-1, -1)`` (unbounded). The
    left value alone is FlashInfer's ``window_left``.
    """
    return (sliding_window - 1, 0) if sliding_window else (-1, -1)
