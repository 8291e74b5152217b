"""The hooks a general plugin may implement (pluggy project name ``llmhal``).

A general plugin's entry point (group ``vllm.general_plugins``) may name a module, or any object,
whose functions are marked with :data:`hookimpl`. llmhal registers it with a pluggy
``PluginManager``; pluggy checks each implementation's arguments against the specs below, and an
implementation of a hook that does not exist is rejected too. Each hook is called once per process,
from :func:`llmhal.plugins.load_general_plugins`, in plugin discovery order. Implementations must be
idempotent: the same plugin runs in every process of a deployment.

Example::

    # my_vendor/hooks.py, with entry point  my_vendor = my_vendor.hooks  in vllm.general_plugins
    from llmhal.plugins.hookspecs import hookimpl

    @hookimpl
    def llmhal_register_models(registry):
        registry.register_model("MyForCausalLM", "my_vendor.model:MyForCausalLM")

A plain zero-argument callable is accepted as well (vLLM's convention): it is simply called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT_NAME = "llmhal"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class LlmhalHookSpecs:
    """Hook specifications. Arguments are passed by keyword; an implementation may take fewer."""

    @hookspec
    def llmhal_register_models(self, registry: Any) -> None:
        """Register model architectures: ``registry.register_model(arch, "pkg.mod:Class")``.

        ``registry`` is :class:`llmhal.models.registry.ModelRegistry`.
        """

    @hookspec
    def llmhal_register_attention_backends(self, register: Callable[[str, str], Any]) -> None:
        """Register attention backends: ``register(name, "pkg.mod:BackendClass")``."""

    @hookspec
    def llmhal_register_quantization_configs(self, register: Callable[[str, str], Any]) -> None:
        """Register quantization methods: ``register(name, "pkg.mod:ConfigClass")``."""

    @hookspec
    def llmhal_register_ops(self, register: Callable[[str, str], Any]) -> None:
        """Register custom-op kernels: ``register(op_name, "pkg.mod:function")``.

        A kernel registered this way overrides the platform's and core's implementation of that op.
        """
