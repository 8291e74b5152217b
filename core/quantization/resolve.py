"""Deciding a model's quantization method and checking it before any weight loads.

Order: the checkpoint's own method (``quantization_config.quant_method``, or "gguf" for a GGUF file)
may be claimed by another registered method (``override_quantization_method``, e.g. gptq -> a GPU
kernel variant). A user's ``quantization=`` must agree with it, name a kernel variant of the
checkpoint's method (``awq_marlin`` for an ``awq`` checkpoint, as vLLM accepts), or, for an
unquantized checkpoint, name a method that quantizes online. Then: the platform's allow-list, the method's availability on this
platform, its minimum device capability and its activation dtypes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from llmhal.logger import init_logger
from llmhal.quantization.registry import (
    CORE,
    REGISTERED,
    get_quantization_config,
    list_quantization_methods,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from llmhal.platforms import Platform
    from llmhal.quantization.base import QuantizationConfig

logger = init_logger(__name__)


class QuantizationError(ValueError):
    """The requested or detected quantization cannot be used here; the message says what to do."""


def _usable_entries(platform: Platform) -> list[str]:
    return [
        e.name
        for e in list_quantization_methods()
        if e.provider in (CORE, REGISTERED, platform.name)
    ]


def _claimed_by(method: str, cfg: dict[str, Any], user: str | None, platform: Platform) -> str:
    for name in _usable_entries(platform):
        if name == method:
            continue
        try:
            cls = get_quantization_config(name)
        except Exception as e:  # a broken method must not hide the checkpoint's own
            logger.debug("quantization method %s not importable: %s", name, e)
            continue
        claimed = cls.override_quantization_method(cfg, user)
        if claimed:
            logger.info("Quantization method %s claims this %s checkpoint", claimed, method)
            return claimed
    return method


def _supporting_platforms(method: str) -> list[str]:
    from llmhal.platforms.resolver import declared_platform_classes
    from llmhal.utils.imports import resolve_obj_by_qualname

    out = []
    for entry, path in declared_platform_classes().items():
        try:
            cls = resolve_obj_by_qualname(path)
        except Exception:
            continue
        allowed = getattr(cls, "supported_quantization", None)
        provides = method in getattr(cls, "quantization_methods", {})
        if (
            provides
            or (allowed is None and method in _core_names())
            or (allowed is not None and method in allowed)
        ):
            out.append(getattr(cls, "name", entry) or entry)
    return out


def _core_names() -> set[str]:
    from llmhal.quantization.registry import CORE_METHODS

    return set(CORE_METHODS)


def check_method_usable(name: str, cls: type, platform: Platform, act_dtype: torch.dtype) -> None:
    """Raise :class:`QuantizationError` naming the remedy when ``name`` cannot run here."""
    reasons = []
    try:
        platform.verify_quantization(name)
    except ValueError as e:
        reasons.append(str(e))
    reasons += list(cls.availability(platform))
    cap = platform.device_capability()
    need = cls.get_min_capability()
    if cap is not None and need > 0 and cap.to_int() < need:
        reasons.append(
            f"needs device capability {need // 10}.{need % 10}, this device has {cap.as_version_str()}"
        )
    dtypes = cls.get_supported_act_dtypes()
    if dtypes and act_dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        reasons.append(
            f"activation dtype {str(act_dtype).removeprefix('torch.')} not supported (supported: {names}; pass dtype=...)"
        )
    if reasons:
        others = [p for p in _supporting_platforms(name) if p != platform.name]
        here = [m for m in _usable_entries(platform) if m != name]
        raise QuantizationError(
            f"Quantization method {name!r} cannot run on the {platform.name} platform:\n"
            + "".join(f"  - {r}\n" for r in reasons)
            + (f"Platforms that support it: {', '.join(others)}. " if others else "")
            + f"Methods registered here: {', '.join(here) or 'none'}."
        )


def resolve_quantization(
    checkpoint_method: str | None,
    checkpoint_config: dict[str, Any] | None,
    user: str | None,
    platform: Platform,
    act_dtype: torch.dtype,
    from_checkpoint: Callable[[type], QuantizationConfig],
) -> tuple[str | None, QuantizationConfig | None]:
    """Return (method name, built config) or (None, None) for an unquantized model."""
    user = user.strip().lower() if user else None
    ckpt = checkpoint_method.strip().lower() if checkpoint_method else None
    if ckpt:
        name = _claimed_by(ckpt, checkpoint_config or {}, user, platform)
        provider = _variant_provider(user, ckpt) if user and user not in (ckpt, name) else None
        if provider is not None and provider not in (CORE, REGISTERED, platform.name):
            raise QuantizationError(
                f"quantization={user!r} is the {provider} platform's kernel for {ckpt!r} "
                f"checkpoints and needs the {provider} platform; this is the {platform.name} "
                f"platform. Drop the quantization argument (or pass quantization={ckpt!r}) to run "
                f"this checkpoint with {name!r} here."
            )
        if provider is not None:
            # A kernel variant for this format (awq_marlin for awq): the user's override stands,
            # and check_method_usable below says what it needs when it cannot run here.
            name = user
        if user and user not in (ckpt, name):
            raise QuantizationError(
                f"The checkpoint is quantized with {ckpt!r}, but quantization={user!r} was requested. "
                f"Drop the quantization argument (or pass quantization={ckpt!r})."
            )
    elif user:
        name = user
    else:
        return None, None
    try:
        cls = get_quantization_config(name)
    except ValueError as e:
        raise QuantizationError(str(e)) from None
    if not ckpt and not cls.is_online():
        online = [m for m in _usable_entries(platform) if _is_online(m)]
        raise QuantizationError(
            f"quantization={name!r} needs a checkpoint quantized with {name}; this checkpoint is not "
            f"quantized. Methods that can quantize it while loading: {', '.join(online) or 'none'}."
        )
    check_method_usable(name, cls, platform, act_dtype)
    config = from_checkpoint(cls) if ckpt else cls.online_config()
    return name, config


def _variant_provider(variant: str, checkpoint_method: str) -> str | None:
    """The provider of method ``variant`` when it reads ``checkpoint_method``'s checkpoints (its
    config subclasses that method's: a kernel variant such as awq_marlin of awq), else None. The
    class is looked up wherever it is declared, active platform or not, so that the error can say
    which platform it needs."""
    from llmhal.quantization.registry import get_method_entry
    from llmhal.utils.imports import resolve_obj_by_qualname

    entry, base = get_method_entry(variant), get_method_entry(checkpoint_method)
    if entry is None or base is None:
        return None
    try:
        variant_cls = resolve_obj_by_qualname(entry.class_path)
        checkpoint_cls = resolve_obj_by_qualname(base.class_path)
    except Exception:
        return None
    if variant_cls is checkpoint_cls or not issubclass(variant_cls, checkpoint_cls):
        return None
    return entry.provider


def _is_online(name: str) -> bool:
    try:
        return bool(get_quantization_config(name).is_online())
    except Exception:
        return False
