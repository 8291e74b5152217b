"""The attention-backend contract.

A backend is a class with three collaborators:

* the **backend class** (:class:`AttentionBackend`): declares what it supports and validates a
  configuration (:meth:`AttentionBackend.validate` returns human-readable reasons, empty = usable);
* the **metadata builder** (:class:`AttentionMetadataBuilder`): turns the engine's per-step
  :class:`CommonAttentionMetadata` into the backend's own metadata, once per step (shared by layers);
* the **implementation** (:class:`AttentionImpl`): one per attention layer; writes the step's new keys
  and values into the layer's paged KV cache and computes attention.

Paged KV cache: the cache of a layer is one tensor of shape :meth:`AttentionBackend.get_kv_cache_shape`
allocated by the engine, split in fixed-size blocks of ``block_size`` token slots. A request owns a
list of blocks (a row of ``block_table``); the token at position ``p`` of request ``r`` lives in slot
``block_table[r, p // block_size] * block_size + p % block_size``. ``slot_mapping`` gives that slot for
each new token of the step. The layout inside the tensor belongs to the backend.

Masking semantics every backend implements (the reference in ``reference.py`` is the definition):
causal over positions; with ``sliding_window = W`` a query at position ``p`` sees keys at positions
``p - W < k <= p``; with ``logits_soft_cap = c`` scores become ``c * tanh(score / c)`` before softmax;
GQA/MQA map query head ``h`` to KV head ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from llmhal.platforms import Platform

# What kind of sequence mixer a backend serves. A model layer's kind narrows the candidates: a Mamba
# layer never gets flash_attn, and an MHA layer never gets a Mamba backend.
ATTENTION_KINDS = ("mha", "mla", "mamba1", "mamba2", "linear", "short_conv", "tree")
ATTENTION_TYPES = ("decoder", "encoder", "encoder_only", "encoder_decoder")
# "auto" stores the KV cache in the model dtype; fp8 variants store scaled fp8 values; int8 and nvfp4
# store quantized rows with their own scales (llmhal.attention.kv_formats describes each).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8", "nvfp4")


@dataclass(frozen=True)
class MultipleOf:
    """A block-size rule: any multiple of ``base``."""

    base: int

    def accepts(self, block_size: int) -> bool:
        return block_size % self.base == 0

    def __str__(self) -> str:
        return f"multiple of {self.base}"


@dataclass(frozen=True)
class AttentionRequirements:
    """What one model layer needs from an attention backend: the selector's input.

    ``device_capability`` is filled in by the selector from the current platform.
    """

    head_size: int
    num_heads: int
    num_kv_heads: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    kind: str = "mha"
    attn_type: str = "decoder"
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    device_capability: tuple[int, int] | None = None

    def describe(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        extra = []
        if self.sliding_window:
            extra.append(f"sliding_window={self.sliding_window}")
        if self.logits_soft_cap:
            extra.append(f"logits_soft_cap={self.logits_soft_cap}")
        if self.kind != "mha":
            extra.append(f"kind={self.kind}")
        return (
            f"head_size={self.head_size}, heads={self.num_heads}/{self.num_kv_heads} (q/kv), dtype={dt}, "
            f"kv_cache_dtype={self.kv_cache_dtype}, block_size={self.block_size}"
            + "".join(f", {e}" for e in extra)
        )


@dataclass
class CommonAttentionMetadata:
    """The engine's description of one step, independent of any backend.

    Requests are ordered decodes first (``query_len == 1``), then prefills and prefill chunks. Every
    tensor lives on the model's device; the ``*_cpu`` twins let builders read sizes without a sync.

    Attributes:
        query_start_loc: int32 [num_reqs + 1], cumulative query lengths (the new tokens per request).
        seq_lens: int32 [num_reqs], KV length after this step (cached + new tokens).
        num_computed_tokens_cpu: int32 [num_reqs], tokens already in the cache before this step.
        block_table: int32 [num_reqs, max_blocks], the blocks of each request, in order.
        slot_mapping: int64 [num_actual_tokens], cache slot of each new token (-1 = padding).
        positions: int64 [num_actual_tokens], the position of each new token in its sequence.
        num_decodes / num_decode_tokens: the leading requests with a single new token.
        tree_mask: for speculative-draft verification, bool [q, q]: new token ``i`` may see new token
            ``j``; it replaces the causal mask among the new tokens of every request whose query
            length is ``q`` (tokens already in the cache stay fully visible).
        state_indices: int32 [num_reqs], each request's slot in the recurrent layers' state cache
            (see :mod:`llmhal.attention.state`); None for models without recurrent layers.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    num_decode_tokens: int
    causal: bool = True
    tree_mask: torch.Tensor | None = None
    state_indices: torch.Tensor | None = None
    # bool [num_reqs]: which requests the tree mask applies to (None: every request whose query
    # length is the tree's); set by the engine, so a prefill chunk of that length stays causal.
    tree_requests: torch.Tensor | None = None

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes

    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]


M = TypeVar("M")


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Builds a backend's metadata once per step; the result is shared by all its layers."""

    def __init__(self, requirements: AttentionRequirements, device: torch.device) -> None:
        self.requirements = requirements
        self.device = device

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> M:
        """Derive this backend's metadata from the step description."""


class AttentionLayerState:
    """What an implementation may read from its layer besides the tensors: the fp8 KV scales.

    ``k_scale``/``v_scale`` are float32 scalars: a stored fp8 value ``q`` means ``q * scale``.
    They are 1.0 unless the checkpoint or calibration provides them.
    """

    k_scale: torch.Tensor
    v_scale: torch.Tensor


class AttentionImpl(ABC, Generic[M]):
    """One attention layer's computation. Constructed once per layer by the model."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        *,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = "decoder",
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = attn_type

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayerState,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: M,
    ) -> torch.Tensor:
        """Store the step's keys/values in ``kv_cache`` at ``slot_mapping``, then attend.

        ``query`` is [T, num_heads, head_size]; ``key``/``value`` are [T, num_kv_heads, head_size]
        (T = num_actual_tokens). Returns [T, num_heads, head_size] in the query's dtype.
        """


class AttentionBackend(ABC):
    """A named attention implementation and the rules for when it can be used.

    Subclasses declare support as class attributes; :meth:`validate` turns them into reasons. Use
    :meth:`supports_combination` for rules the attributes cannot express, and :meth:`availability`
    for what the host lacks (a library, a device generation).
    """

    name: ClassVar[str]
    kind: ClassVar[str] = "mha"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16")
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None  # None: any
    supported_block_sizes: ClassVar[tuple[int | MultipleOf, ...] | None] = None  # None: any
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    supported_attn_types: ClassVar[tuple[str, ...]] = ("decoder",)
    supports_sliding_window: ClassVar[bool] = False
    supports_logits_soft_cap: ClassVar[bool] = False
    min_device_capability: ClassVar[tuple[int, int] | None] = None

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl[Any]]: ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder[Any]]: ...

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: str = "auto",
    ) -> tuple[int, ...]:
        """The shape of one layer's KV cache tensor (keys and values together)."""

    @classmethod
    def kv_cache_torch_dtype(cls, model_dtype: torch.dtype, cache_dtype: str) -> torch.dtype:
        """The element dtype of the KV cache tensor."""
        from llmhal.attention.kv_formats import storage_dtype

        return storage_dtype(cache_dtype, model_dtype)

    @classmethod
    def availability(cls, platform: Platform) -> list[str]:
        """Reasons this backend cannot run on ``platform`` at all (empty = it can).

        Checked without importing optional libraries (``importlib.util.find_spec`` is enough).
        """
        return []

    @classmethod
    def supports_combination(cls, requirements: AttentionRequirements) -> str | None:
        """A reason the combination is unsupported, for rules the attributes do not cover."""
        return None

    @classmethod
    def validate(
        cls, requirements: AttentionRequirements, platform: Platform | None = None
    ) -> list[str]:
        """Every reason this backend cannot serve ``requirements`` (empty = usable)."""
        r = requirements
        reasons: list[str] = []
        if platform is not None:
            reasons += cls.availability(platform)
        if r.kind != cls.kind:
            reasons.append(f"serves {cls.kind} layers, not {r.kind}")
        if cls.supported_head_sizes is not None and r.head_size not in cls.supported_head_sizes:
            reasons.append(
                f"head_size {r.head_size} not supported (supported: {', '.join(map(str, cls.supported_head_sizes))})"
            )
        dt = str(r.dtype).removeprefix("torch.")
        if dt not in cls.supported_dtypes:
            reasons.append(
                f"dtype {dt} not supported (supported: {', '.join(cls.supported_dtypes)})"
            )
        if r.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            reasons.append(
                f"kv_cache_dtype {r.kv_cache_dtype} not supported (supported: {', '.join(cls.supported_kv_cache_dtypes)})"
            )
        elif r.kv_cache_dtype != "auto":
            from llmhal.attention.kv_formats import head_size_reason

            fmt_reason = head_size_reason(r.kv_cache_dtype, r.head_size)
            if fmt_reason:
                reasons.append(fmt_reason)
        if cls.supported_block_sizes is not None and not any(
            (b.accepts(r.block_size) if isinstance(b, MultipleOf) else b == r.block_size)
            for b in cls.supported_block_sizes
        ):
            reasons.append(
                f"block_size {r.block_size} not supported (supported: {', '.join(map(str, cls.supported_block_sizes))})"
            )
        if r.attn_type not in cls.supported_attn_types:
            reasons.append(f"attention type {r.attn_type} not supported")
        if r.sliding_window and not cls.supports_sliding_window:
            reasons.append("sliding window not supported")
        if r.logits_soft_cap and not cls.supports_logits_soft_cap:
            reasons.append("logits soft-capping not supported")
        if cls.min_device_capability is not None:
            cap = r.device_capability
            if cap is None or tuple(cap) < tuple(cls.min_device_capability):
                need = ".".join(map(str, cls.min_device_capability))
                have = ".".join(map(str, cap)) if cap else "none"
                reasons.append(f"needs device capability >= {need} (this device: {have})")
        extra = cls.supports_combination(r)
        if extra:
            reasons.append(extra)
        return reasons
