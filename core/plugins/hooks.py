"""Running general plugins: plain callables, or pluggy hook modules validated against the specs."""

from __future__ import annotations

import inspect
from typing import Any

from llmhal.logger import init_logger
from llmhal.plugins import GENERAL_PLUGINS_GROUP, mark_failed

logger = init_logger(__name__)


class PluginValidationError(TypeError):
    """A general plugin's hook implementation does not match llmhal's hook specification."""


def _has_hookimpls(obj: Any) -> bool:
    from llmhal.plugins.hookspecs import PROJECT_NAME

    marker = f"{PROJECT_NAME}_impl"
    return any(
        hasattr(getattr(obj, attr, None), marker) for attr in dir(obj) if not attr.startswith("__")
    )


def _make_manager() -> Any:
    import pluggy

    from llmhal.plugins.hookspecs import PROJECT_NAME, LlmhalHookSpecs

    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(LlmhalHookSpecs)
    return pm


def _register_hook_plugin(pm: Any, name: str, obj: Any) -> None:
    """Register ``obj`` and reject bad signatures or unknown hooks with a message naming both."""
    import pluggy

    try:
        pm.register(obj, name=name)
        for hook_name, impls in _unknown_hooks(pm, name):
            raise pluggy.PluginValidationError(
                obj, f"unknown hook {hook_name!r} ({impls}); known hooks: {_known_hooks(pm)}"
            )
    except pluggy.PluginValidationError as e:
        if pm.is_registered(obj):
            pm.unregister(obj)
        raise PluginValidationError(
            f"General plugin {name!r} has an invalid hook implementation: {e}. "
            f"The hooks and their arguments are documented in llmhal.plugins.hookspecs."
        ) from e


def _known_hooks(pm: Any) -> str:
    return ", ".join(sorted(n for n in dir(pm.hook) if n.startswith("llmhal_")))


def _unknown_hooks(pm: Any, name: str) -> list[tuple[str, str]]:
    out = []
    for hook_name in dir(pm.hook):
        if hook_name.startswith("_"):
            continue
        caller = getattr(pm.hook, hook_name)
        if getattr(caller, "spec", None) is None:
            impls = [i for i in caller.get_hookimpls() if i.plugin_name == name]
            if impls:
                out.append((hook_name, f"in plugin {name!r}"))
    return out


def _hook_arguments() -> dict[str, dict[str, Any]]:
    from llmhal.attention.registry import register_attention_backend
    from llmhal.models.registry import ModelRegistry
    from llmhal.ops.registry import register_op_kernel
    from llmhal.quantization.registry import register_quantization_config_path

    return {
        "llmhal_register_models": {"registry": ModelRegistry},
        "llmhal_register_attention_backends": {"register": register_attention_backend},
        "llmhal_register_quantization_configs": {"register": register_quantization_config_path},
        "llmhal_register_ops": {"register": register_op_kernel},
    }


def run_general_plugins(plugins: dict[str, Any]) -> None:
    """Call plain callables; register hook objects, then call each hook once for all of them."""
    pm = None
    for name, obj in plugins.items():
        try:
            if _has_hookimpls(obj):
                pm = pm or _make_manager()
                _register_hook_plugin(pm, name, obj)
            elif callable(obj) and not inspect.ismodule(obj):
                obj()
            else:
                raise PluginValidationError(
                    f"General plugin {name!r} is a {type(obj).__name__}, neither a zero-argument "
                    f"callable nor an object with @hookimpl functions of llmhal.plugins.hookspecs."
                )
        except Exception as e:
            mark_failed(GENERAL_PLUGINS_GROUP, name, f"{type(e).__name__}: {e}", e)
    if pm is None:
        return
    for hook_name, kwargs in _hook_arguments().items():
        caller = getattr(pm.hook, hook_name)
        for impl in caller.get_hookimpls():
            try:
                argnames = impl.argnames
                impl.function(**{k: v for k, v in kwargs.items() if k in argnames})
            except Exception as e:
                mark_failed(
                    GENERAL_PLUGINS_GROUP,
                    impl.plugin_name,
                    f"hook {hook_name} raised {type(e).__name__}: {e}",
                    e,
                )
