"""The recurrent-layer contract: layers that keep a fixed-size state per request instead of a
growing KV cache (Mamba-1, Mamba-2, short convolutions, linear attention).

Three pieces, mirroring the paged-attention contract in :mod:`llmhal.attention.backend`:

* :class:`RecurrentLayer` -- the model's module. It declares its ``kind`` (one of
  :data:`RECURRENT_KINDS`) and, in :meth:`RecurrentLayer.state_specs`, the shape and dtype of each
  state tensor it needs *per request* (e.g. Mamba: a conv state and an SSM state). Its backend is
  selected by kind through the attention registry at construction.
* the engine (:mod:`llmhal.engine.state_cache`) -- gives every running request one *slot*, the same
  index in every recurrent layer, and binds ``layer.states``: one tensor per spec, of shape
  ``[num_slots, *spec.shape]``. A slot is taken when the request is admitted and released when it
  finishes, is aborted or is preempted; a preempted request is recomputed from its first token with
  a fresh state (a state cannot be rolled back). Prefix caching is off for models with these layers.
* the backend (:class:`RecurrentBackend` subclasses, registered by kind) -- its builder turns the
  step description into :class:`RecurrentMetadata` once per step, shared by every layer of that
  backend. The layer computes itself with custom ops (``llmhal.ops``), which platforms override;
  the backend carries no implementation object.

How to write a new recurrent layer (e.g. a short convolution)::

    class ShortConv(RecurrentLayer):
        def __init__(self, config, prefix=""):
            super().__init__("short_conv", prefix=prefix)
            ...  # parameters
        def state_specs(self):
            return (StateSpec("conv", (self.width - 1, self.dim), self.model_dtype),)
        def forward(self, hidden):                       # hidden: [T, hidden_size], T tokens
            meta = self.metadata()                       # RecurrentMetadata of this step
            (conv_state,) = self.states                  # [num_slots, width - 1, dim]
            d = meta.num_decode_tokens                   # tokens [0, d): one per decode request
            # decodes: x[:d] with state slots meta.decode_state_indices (in place);
            # prefills: x[d:] split by meta.prefill_query_start_loc (starts at 0), state slots
            # meta.prefill_state_indices, meta.prefill_has_initial_state (False: start from zeros,
            # whatever the slot holds; True: continue from the slot, a later prefill chunk).
            ...

Rules: a layer reads and writes only the slots the metadata names; it writes the state after the
last token of every request it was given (the next chunk or decode continues from it); it must
not depend on what a slot held before when ``has_initial_state`` is False. Decodes always continue
their slot: a request whose first step is one token runs as a decode, and the engine zeroes its
slot (every state tensor) before that step. Register the backend of a
new kind in :data:`llmhal.attention.registry.CORE_BACKENDS` with its kind (or with
``register_attention_backend(name, path, kind=...)``); a model may mix recurrent layers with
:class:`llmhal.attention.layer.Attention` layers (a hybrid), which use the paged KV cache.

Backend selection: a layer of kind ``k`` takes the platform's first valid backend of kind ``k``. An
explicit ``VLLM_ATTENTION_BACKEND`` (or ``attention_backend=``) applies to the layers of its own
kind; other layers select by kind, and a choice that serves no layer of the model is refused
(:func:`check_explicit_choice`), naming the model's kinds and the backends that serve them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from llmhal.attention.backend import (
    KV_CACHE_DTYPES,
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionRequirements,
    CommonAttentionMetadata,
)

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.attention.selector import AttentionSelection

RECURRENT_KINDS = ("mamba1", "mamba2", "linear", "short_conv")

# vLLM's values of ``mamba_cache_dtype`` / ``mamba_ssm_cache_dtype`` ("auto" first).
MAMBA_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
_STATE_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def check_mamba_cache_dtypes(
    mamba_cache_dtype: str, mamba_ssm_cache_dtype: str, platform: Any = None
) -> None:
    """Refuse an unknown value, or one the platform's state kernels cannot serve, before the model
    loads. A platform declares what its kernels read and write in ``supported_mamba_cache_dtypes``
    (absent: every value; the reference kernels in core take any float dtype)."""
    for flag, value in (
        ("mamba_cache_dtype", mamba_cache_dtype),
        ("mamba_ssm_cache_dtype", mamba_ssm_cache_dtype),
    ):
        if value not in MAMBA_CACHE_DTYPES:
            raise ValueError(
                f"{flag}={value!r} is not one of vLLM's values: {', '.join(MAMBA_CACHE_DTYPES)}"
            )
        supported = getattr(platform, "supported_mamba_cache_dtypes", None)
        if value != "auto" and supported is not None and value not in supported:
            raise ValueError(
                f"{flag}={value!r}: the {platform.name} platform's state kernels read and write "
                f"{', '.join(supported)} states; choose one of them (or auto: the model's dtype)"
            )


def mamba_state_dtypes(
    model_dtype: torch.dtype, mamba_cache_dtype: str = "auto", mamba_ssm_cache_dtype: str = "auto"
) -> tuple[torch.dtype, torch.dtype]:
    """(conv state dtype, SSM state dtype), as vLLM's ``MambaStateDtypeCalculator`` decides them:
    ``mamba_cache_dtype`` sets both ("auto": the model's dtype), ``mamba_ssm_cache_dtype`` the SSM
    state alone ("auto": the same as the conv state). Linear attention's state and short
    convolutions' state follow ``mamba_cache_dtype`` (the first)."""
    conv = _STATE_TORCH_DTYPES.get(mamba_cache_dtype, model_dtype)
    ssm = conv if mamba_ssm_cache_dtype == "auto" else _STATE_TORCH_DTYPES[mamba_ssm_cache_dtype]
    return conv, ssm


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of a recurrent layer, per request: ``name`` (for messages), its shape
    without the slot axis, and its dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass
class RecurrentMetadata:
    """One step as a recurrent layer sees it. Requests are ordered decodes first (one token each),
    then prefills (a whole prompt or a chunk of one). Tensors live on the model's device.

    Attributes:
        query_start_loc: int32 [num_reqs + 1], cumulative new tokens per request (all requests).
        state_indices: int32 [num_reqs], each request's state slot.
        has_initial_state: bool [num_reqs], True when the request continues a state (tokens were
            computed before this step: a decode, or a later prefill chunk).
        decode_state_indices: ``state_indices[:num_decodes]``.
        prefill_query_start_loc: int32 [num_prefills + 1], the prefills' cumulative lengths counted
            from the first prefill token (token ``num_decode_tokens`` of the step).
        prefill_state_indices / prefill_has_initial_state: the prefills' rows of the above.
        prefill_query_lens_cpu: int32 [num_prefills] on the host, for splitting without a sync.

    A step of decodes only derives nothing from the step's inputs (so that it can be recorded as a
    decode-step graph, :mod:`llmhal.engine.decode_graphs`): ``has_initial_state`` and
    ``prefill_has_initial_state`` are None (decodes always continue their slot) and the prefill
    fields are empty views. Layers read the prefill fields only when ``num_prefills`` > 0.
    """

    num_reqs: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor | None
    decode_state_indices: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_state_indices: torch.Tensor
    prefill_has_initial_state: torch.Tensor | None
    prefill_query_lens_cpu: torch.Tensor
    max_prefill_len: int


class RecurrentMetadataBuilder(AttentionMetadataBuilder[RecurrentMetadata]):
    """Derives :class:`RecurrentMetadata` from the step; every recurrent kind can share it."""

    def build(self, common: CommonAttentionMetadata) -> RecurrentMetadata:
        slots = getattr(common, "state_indices", None)
        if slots is None:
            raise RuntimeError(
                "this step has no state slots (CommonAttentionMetadata.state_indices): recurrent "
                "layers run only in an engine whose state cache gave each request a slot"
            )
        nd = common.num_decodes
        qsl = common.query_start_loc
        if nd == common.num_reqs:  # decodes only: views of the step's tensors, nothing computed
            has_init = prefill_has_init = None
            # query_start_loc starts at 0: its first entry is the [0] of zero prefills.
            prefill_qsl, prefill_lens = qsl[:1], common.query_start_loc_cpu[:0]
        else:
            has_init = (common.num_computed_tokens_cpu > 0).to(self.device)
            prefill_has_init = has_init[nd:]
            prefill_qsl = qsl[nd:] - qsl[nd]
            prefill_lens = common.query_start_loc_cpu[nd + 1 :] - common.query_start_loc_cpu[nd:-1]
        return RecurrentMetadata(
            num_reqs=common.num_reqs,
            num_decodes=nd,
            num_decode_tokens=common.num_decode_tokens,
            num_prefills=common.num_reqs - nd,
            num_actual_tokens=common.num_actual_tokens,
            query_start_loc=qsl,
            state_indices=slots,
            has_initial_state=has_init,
            decode_state_indices=slots[:nd],
            prefill_query_start_loc=prefill_qsl,
            prefill_state_indices=slots[nd:],
            prefill_has_initial_state=prefill_has_init,
            prefill_query_lens_cpu=prefill_lens,
            max_prefill_len=int(prefill_lens.max()) if len(prefill_lens) else 0,
        )


class _NoImpl(AttentionImpl[Any]):
    """Recurrent layers compute in their own module (with custom ops); nothing to build here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "recurrent backends have no attention implementation: the layer computes itself"
        )

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # pragma: no cover
        raise TypeError("recurrent backends have no attention implementation")


class RecurrentBackend(AttentionBackend):
    """Base of the backends that serve recurrent layers: metadata only, no paged KV cache.

    The KV-cache dtype does not apply (states are stored as the layer's :class:`StateSpec` says),
    so every value is accepted.
    """

    kind: ClassVar[str]
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16", "bfloat16")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = KV_CACHE_DTYPES

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl[Any]]:
        return _NoImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder[Any]]:
        return RecurrentMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: str = "auto",
    ) -> tuple[int, ...]:
        raise TypeError(
            "recurrent layers keep per-request states (StateSpec), not a paged KV cache"
        )


def explicit_backend_choice(explicit: str | None) -> str | None:
    """The user's backend choice: the engine config's, else ``VLLM_ATTENTION_BACKEND``."""
    return explicit or os.environ.get("VLLM_ATTENTION_BACKEND", "").strip() or None


def select_recurrent_backend(
    requirements: AttentionRequirements, explicit: str | None
) -> AttentionSelection:
    """The backend of a recurrent layer: the explicit choice when it is of this layer's kind (it is
    then validated like any choice), else the platform's first valid backend of the kind."""
    from llmhal.attention.registry import get_backend_entry, list_attention_backends
    from llmhal.attention.selector import AttentionBackendError, select_attention_backend
    from llmhal.platforms import get_current_platform

    choice = explicit_backend_choice(explicit)
    if choice:
        entry = get_backend_entry(choice)
        if entry is not None and entry.kind in (None, requirements.kind):
            return select_attention_backend(requirements, explicit=choice)
    kind = requirements.kind
    if not any(e.kind == kind for e in list_attention_backends()):
        platform = get_current_platform()
        raise AttentionBackendError(
            f"No attention backend of kind {kind!r} is registered on the {platform.name} platform, "
            f"so this model's {kind} layers cannot run. Backends by kind: "
            f"{format_backends_by_kind()}. Install a platform package that provides one, or "
            f"register one with register_attention_backend(name, path, kind={kind!r})."
        )
    return select_attention_backend(requirements, explicit=None, ignore_explicit=True)


def format_backends_by_kind() -> str:
    from llmhal.attention.registry import list_attention_backends

    by_kind: dict[str, list[str]] = {}
    for e in list_attention_backends():
        by_kind.setdefault(e.kind or "unknown", []).append(e.name)
    return "; ".join(f"{k}: {', '.join(sorted(v))}" for k, v in sorted(by_kind.items()))


def check_explicit_choice(selections: list[AttentionSelection], explicit: str | None) -> None:
    """Refuse an explicit backend choice that serves none of the model's layers (it would otherwise
    be silently ignored): the error names the model's layer kinds and the backends of each."""
    from llmhal.attention.registry import list_attention_backends, normalize
    from llmhal.attention.selector import AttentionBackendError

    choice = explicit_backend_choice(explicit)
    if not choice or not selections or any(s.name == normalize(choice) for s in selections):
        return
    kinds = sorted({s.requirements.kind for s in selections})
    entries = {e.name: e for e in list_attention_backends()}
    chosen = entries.get(normalize(choice))
    what = f"serves {chosen.kind} layers" if chosen and chosen.kind else "is not a known backend"
    can = "; ".join(
        f"{k}: {', '.join(sorted(n for n, e in entries.items() if e.kind == k)) or 'none'}"
        for k in kinds
    )
    raise AttentionBackendError(
        f"Attention backend {choice!r} (VLLM_ATTENTION_BACKEND or attention_backend=) {what}, but "
        f"this model's layers are of kind {', '.join(kinds)}. Backends that can serve them: {can}. "
        "Choose one of them, or unset the choice to select by kind."
    )


class RecurrentLayer(nn.Module):
    """Base of every layer with a per-request state (see the module docstring for the contract).

    Subclasses call ``super().__init__(kind, prefix=...)`` first, then implement
    :meth:`state_specs` and ``forward``. ``head_size``/``num_heads`` only describe the layer in
    messages and to backends that restrict them.
    """

    kind: str

    def __init__(
        self, kind: str, *, prefix: str = "", head_size: int = 0, num_heads: int = 1
    ) -> None:
        super().__init__()
        from llmhal.config import get_current_config

        if kind not in RECURRENT_KINDS:
            raise ValueError(
                f"unknown recurrent kind {kind!r}; kinds: {', '.join(RECURRENT_KINDS)}"
            )
        cfg = get_current_config()
        self.kind = kind
        self.layer_name = prefix
        self.model_dtype = cfg.model.dtype
        # Where this layer's states are kept (CacheConfig.mamba_cache_dtype / _ssm_cache_dtype);
        # arithmetic on them is float32 in every kernel, whatever they are stored in.
        self.conv_state_dtype, self.ssm_state_dtype = mamba_state_dtypes(
            cfg.model.dtype, cfg.cache.mamba_cache_dtype, cfg.cache.mamba_ssm_cache_dtype
        )
        self.requirements = AttentionRequirements(
            head_size=head_size,
            num_heads=num_heads,
            num_kv_heads=num_heads,
            dtype=cfg.model.dtype,
            kv_cache_dtype=cfg.cache.kv_cache_dtype,
            block_size=cfg.cache.block_size,
            kind=kind,
        )
        self.selection = select_recurrent_backend(self.requirements, cfg.attention_backend)
        self.backend = self.selection.backend
        # Bound by the engine (ModelRunner.allocate_state_cache): one tensor per state spec.
        self.states: tuple[torch.Tensor, ...] = ()

    def state_specs(self) -> tuple[StateSpec, ...]:
        """The per-request state tensors this layer needs (shape without the slot axis)."""
        raise NotImplementedError

    def metadata(self) -> RecurrentMetadata:
        """This step's metadata from the forward context (inside the model runner's step)."""
        from llmhal.forward_context import get_forward_context

        return get_forward_context().attn_metadata[self.backend.name]


def recurrent_layers(model: nn.Module) -> list[RecurrentLayer]:
    return [m for m in model.modules() if isinstance(m, RecurrentLayer)]
