"""Ready-made throwaway distributions: a complete fake vendor, and platform plugins good and broken.

``fakenpu_distribution()`` is an out-of-tree vendor that uses every plugin group the way a real one
would: a platform that beats the CPU, a pluggy hook module registering a model, an attention backend
and an op kernel, a plain ``register()`` callable, an IO-processor entry and a stat-logger entry. Its
platform runs on the host (``device_type = "cpu"``) so everything it declares really works.

``acme_distribution()`` is a vendor that follows the writing-a-platform guide and so runs on core's
reference code. ``accelerator_distribution(...)`` builds one platform plugin with knobs for each way
a vendor package can go wrong (a probe that raises, a module that fails to import, a class of
another framework, an incompatible API version, touching ``current_platform`` too early, a slow
probe).

Every module records its import with :func:`llmhal.testing.distributions.marker_code` under its
module name, and ``fakenpu.register:register`` records each run under ``fakenpu.register.ran``.
"""

from __future__ import annotations

from dataclasses import replace

from llmhal.testing.distributions import MARKER_DIR_ENV, FakeDistribution, marker_code

PLATFORM = "vllm.platform_plugins"
GENERAL = "vllm.general_plugins"
IO_PROCESSOR = "vllm.io_processor_plugins"
STAT_LOGGER = "vllm.stat_logger_plugins"

REGISTER_RAN_MARKER = "fakenpu.register.ran"


def class_name(name: str) -> str:
    """The platform class name used for the fake platform ``name`` ("acc_a" -> "AccAPlatform")."""
    return "".join(part.title() for part in name.split("_")) + "Platform"


def platform_class_source(
    name: str, *, priority: int = 100, api_version: int = 1, base: str = "Platform", body: str = ""
) -> str:
    """A minimal, conforming platform class on the host CPU (``base`` "object": a foreign one)."""
    imports = "from llmhal.platforms import Platform\n" if base == "Platform" else ""
    return (
        f"{imports}\n\nclass {class_name(name)}({base}):\n"
        f"    PLATFORM_API_VERSION = {api_version}\n"
        f"    name = {name!r}\n"
        f"    device_name = {name + ' accelerator (fake)'!r}\n"
        f"    device_type = 'cpu'\n"
        f"    dispatch_key = 'CPU'\n"
        f"    dist_backend = 'gloo'\n"
        f"    priority = {priority}\n\n"
        f"    def get_device_total_memory(self, device_id=0):\n"
        f"        return 16 << 30\n\n"
        f"    def mem_get_info(self, device_id=0):\n"
        f"        return (12 << 30, 16 << 30)\n" + body
    )


def accelerator_distribution(
    name: str,
    *,
    priority: int = 100,
    api_version: int = 1,
    base: str = "Platform",
    probe_body: str | None = None,
    probe_prelude: str = "",
    platform_prelude: str = "",
    platform_body: str = "",
    version: str = "1.0.0",
) -> FakeDistribution:
    """A distribution ``<name>-fake`` with platform entry point ``<name> = <name>:probe``.

    ``probe_body`` replaces the probe's body (indented four spaces); by default the probe returns the
    class path when llmhal calls it. ``probe_prelude`` and ``platform_prelude`` are module-level code
    run at import of the probe module and of the platform module; ``platform_body`` is added to the
    platform class (methods indented four spaces).
    """
    path = f"{name}.platform:{class_name(name)}"
    body = probe_body or f"    return {path!r}\n"
    probe_module = (
        marker_code(name)
        + probe_prelude
        + "from llmhal.platforms import called_by_llmhal, platform_probe\n\n\n"
        + f"@platform_probe({path!r})\n"
        + "def probe():\n"
        + "    if not called_by_llmhal():\n"
        + "        return None\n"
        + body
    )
    platform_module = (
        marker_code(f"{name}.platform")
        + platform_prelude
        + platform_class_source(
            name, priority=priority, api_version=api_version, base=base, body=platform_body
        )
    )
    return FakeDistribution(
        f"{name}-fake",
        version,
        entry_points={PLATFORM: {name: f"{name}:probe"}},
        modules={f"{name}/__init__.py": probe_module, f"{name}/platform.py": platform_module},
    )


_FAKENPU_PLATFORM_BODY = """
    device_control_env_var = "FAKENPU_VISIBLE_DEVICES"
    attention_backends = {"fakenpu_attn": "fakenpu.attention:FakeNpuAttentionBackend"}
    supported_quantization = ("gguf", "fp8")

    def attention_backend_priority(self, requirements):
        return ["fakenpu_attn", "reference"]
"""

_FAKENPU_HOOKS = """
from llmhal.plugins.hookspecs import hookimpl


@hookimpl
def llmhal_register_models(registry):
    if not registry.is_registered("FakeNpuForCausalLM"):
        registry.register_model("FakeNpuForCausalLM", "fakenpu.model:FakeNpuForCausalLM")


@hookimpl
def llmhal_register_attention_backends(register):
    register("fakenpu_paged", "fakenpu.attention:FakeNpuPagedBackend")


@hookimpl
def llmhal_register_ops(register):
    register("rms_norm", "fakenpu.ops:rms_norm")
"""

# The fake device is the host, so its attention backends delegate to core's reference backend.
_FAKENPU_ATTENTION = """
from llmhal.attention.backend import AttentionBackend


def _reference():
    from llmhal.attention.reference import ReferenceAttentionBackend

    return ReferenceAttentionBackend


class FakeNpuAttentionBackend(AttentionBackend):
    name = "fakenpu_attn"
    supported_dtypes = ("float16", "bfloat16", "float32")

    @staticmethod
    def get_impl_cls():
        return _reference().get_impl_cls()

    @staticmethod
    def get_builder_cls():
        return _reference().get_builder_cls()

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype="auto"):
        return _reference().get_kv_cache_shape(
            num_blocks, block_size, num_kv_heads, head_size, cache_dtype
        )


class FakeNpuPagedBackend(FakeNpuAttentionBackend):
    name = "fakenpu_paged"

    @classmethod
    def availability(cls, platform):
        if platform.name != "fakenpu":
            return [f"needs the fakenpu platform (active: {platform.name})"]
        return []
"""

_FAKENPU_OPS = """
def rms_norm(x, weight, eps):
    from llmhal.ops.native import rms_norm as native

    return native(x, weight, eps)
"""

_FAKENPU_REGISTER = (
    "import os, time\n\n\n"
    "def register():\n"
    "    # Slow on purpose: a second thread calling load_general_plugins() must wait, not rerun.\n"
    "    time.sleep(0.2)\n"
    f"    if os.environ.get({MARKER_DIR_ENV!r}):\n"
    f"        with open(os.path.join(os.environ[{MARKER_DIR_ENV!r}], {REGISTER_RAN_MARKER!r}), 'a') as f:\n"
    "            f.write('x\\n')\n"
)


def fakenpu_distribution(version: str = "0.3.1") -> FakeDistribution:
    """The fake out-of-tree vendor ``fakenpu`` (distribution ``fakenpu``), using every plugin group."""
    platform = accelerator_distribution("fakenpu", priority=100)
    modules = dict(platform.modules)
    modules["fakenpu/platform.py"] = marker_code("fakenpu.platform") + platform_class_source(
        "fakenpu", priority=100, body=_FAKENPU_PLATFORM_BODY
    )
    modules["fakenpu/hooks.py"] = marker_code("fakenpu.hooks") + _FAKENPU_HOOKS
    modules["fakenpu/register.py"] = marker_code("fakenpu.register") + _FAKENPU_REGISTER
    modules["fakenpu/attention.py"] = marker_code("fakenpu.attention") + _FAKENPU_ATTENTION
    modules["fakenpu/ops.py"] = marker_code("fakenpu.ops") + _FAKENPU_OPS
    modules["fakenpu/io.py"] = marker_code("fakenpu.io") + (
        "def io_processor_plugin():\n    return 'fakenpu.io:FakeNpuIOProcessor'\n\n\n"
        "class FakeNpuIOProcessor:\n    pass\n"
    )
    modules["fakenpu/stats.py"] = marker_code("fakenpu.stats") + (
        "class FakeNpuStatLogger:\n    pass\n"
    )
    return FakeDistribution(
        "fakenpu",
        version,
        entry_points={
            PLATFORM: {"fakenpu": "fakenpu:probe"},
            GENERAL: {
                "fakenpu_hooks": "fakenpu.hooks",
                "fakenpu_register": "fakenpu.register:register",
            },
            IO_PROCESSOR: {"fakenpu_io": "fakenpu.io:io_processor_plugin"},
            STAT_LOGGER: {"fakenpu_stats": "fakenpu.stats:FakeNpuStatLogger"},
        },
        modules=modules,
    )


_ACME_PLATFORM_BODY = """
    attention_backends = {"acme_attn": "acme.attn:AcmeBackend"}

    @property
    def capabilities(self):
        from llmhal.platforms import PlatformCapabilities

        return PlatformCapabilities(fast_bf16_matmul=True)

    def attention_backend_priority(self, requirements):
        return ["acme_attn", "reference"]

    def check_and_update_config(self, config):
        config.cache.block_size = 32
"""

_ACME_ATTENTION = """
from llmhal.attention.reference import ReferenceAttentionBackend


class AcmeBackend(ReferenceAttentionBackend):
    name = "acme_attn"
    supported_dtypes = ("bfloat16",)
    supported_block_sizes = (32,)
"""


def acme_distribution() -> FakeDistribution:
    """``acme`` (distribution ``acme-fake``), a vendor that follows docs/writing-a-platform.md:
    priority 100, one attention backend that reuses core's reference kernels and runs bf16 with
    32-token blocks only (its ``check_and_update_config`` sets 32), ``fast_bf16_matmul`` declared,
    no op kernels: everything runs, on core's pure-torch code."""
    dist = accelerator_distribution("acme", platform_body=_ACME_PLATFORM_BODY)
    return replace(dist, modules={**dist.modules, "acme/attn.py": _ACME_ATTENTION})
