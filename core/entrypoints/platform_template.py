"""The files ``llmhal new-platform NAME`` writes: a complete platform package named ``mynpu``.

Every occurrence of ``mynpu`` / ``Mynpu`` / ``MYNPU`` is replaced by the package's name in the same
case (see :func:`llmhal.entrypoints.new_platform.render`). The package runs as written: its
"device" is a stand-in (``mynpu/device.py``) that computes on the host CPU, and its attention
backend reuses llmhal's reference kernels, so it passes the conformance kit and generates text
before any of it is ported. ``docs/writing-a-platform.md`` shows these files (for ``acme``) and a
test keeps the two identical.
"""

from __future__ import annotations

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "mynpu"
version = "0.1.0"
description = "The llmhal platform for mynpu devices"
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["llmhal>=0.1,<0.2"]

# The entry-point name (mynpu) is what users type: VLLM_PLATFORM=mynpu, VLLM_PLUGINS=mynpu,...,
# pytest --llmhal-platform=mynpu.
[project.entry-points."vllm.platform_plugins"]
mynpu = "mynpu:mynpu_platform_plugin"

[tool.setuptools]
packages = ["mynpu"]
"""

INIT = '''\
"""mynpu: the llmhal platform package for mynpu devices.

llmhal imports this module on every machine to call the probe, so it stays cheap: no torch and no
device runtime at import time.
"""

from llmhal.platforms import PlatformUnavailable, called_by_llmhal, platform_probe

__version__ = "0.1.0"


@platform_probe("mynpu.platform:MynpuPlatform", name="mynpu")  # name: MynpuPlatform.name
def mynpu_platform_plugin() -> str | None:
    """Entry point of group vllm.platform_plugins: the platform's class path when a device is here."""
    if not called_by_llmhal():
        return None  # vLLM calls the probes of this group too; never take its place
    from mynpu import device

    if device.device_count() == 0:
        raise PlatformUnavailable(device.why_no_device())  # shown by llmhal doctor and in errors
    return "mynpu.platform:MynpuPlatform"
'''

DEVICE = '''\
"""The device runtime as the platform sees it: replace each function with a call into yours.

This stand-in computes on the host CPU, so the package works as generated. It has one device,
hidden when MYNPU_VISIBLE_DEVICES is set to an empty string (as CUDA_VISIBLE_DEVICES="" hides GPUs).
Import your runtime inside the functions, not at the top: the probe imports this module on
machines without the device.
"""

import os

VISIBLE_DEVICES_ENV = "MYNPU_VISIBLE_DEVICES"


def device_count() -> int:
    visible = os.environ.get(VISIBLE_DEVICES_ENV)
    return 0 if visible is not None and not visible.strip() else 1


def why_no_device() -> str:
    return f"no mynpu device is visible ({VISIBLE_DEVICES_ENV} is set and empty)"


def device_name(index: int) -> str:
    return f"mynpu {index} (host CPU stand-in)"


def memory_info(index: int) -> tuple[int, int]:
    """(free, total) bytes of device memory."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    try:
        free = page * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):  # not every OS reports it
        free = total // 2
    return free, total
'''

PLATFORM = '''\
"""MynpuPlatform: what llmhal needs to know about the device, and the few operations it calls."""

from typing import Any, ClassVar

from llmhal.platforms import Platform, PlatformCapabilities
from mynpu import device

BLOCK_SIZES = (32, 64)  # KV-cache page sizes mynpu_attn reads (see attention.py)


class MynpuPlatform(Platform):
    PLATFORM_API_VERSION = 1  # the llmhal platform contract this class implements

    name = "mynpu"  # lower-case; what users see in messages
    device_name = "mynpu"
    # torch's device type of the tensors. The stand-in computes on the host; a device with its own
    # torch backend says "privateuseone" here (dispatch_key "PrivateUse1").
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"
    device_control_env_var = "MYNPU_VISIBLE_DEVICES"
    priority = 100  # an accelerator (> 0) beats the CPU fallback (priority 0, is_fallback = True)

    # Contributions, as lazy class paths: nothing is imported until a model uses it.
    attention_backends: ClassVar[dict[str, str]] = {
        "mynpu_attn": "mynpu.attention:MynpuAttentionBackend",
    }
    op_kernels: ClassVar[dict[str, str]] = {"rms_norm": "mynpu.ops:rms_norm"}
    quantization_methods: ClassVar[dict[str, str]] = {}
    supported_quantization = None  # None allows every method; or a tuple of names

    @property
    def capabilities(self) -> PlatformCapabilities:
        # Set fast_bf16_matmul=True when the device multiplies bf16 faster than fp32: the "auto"
        # dtype then chooses bf16.
        return PlatformCapabilities(bf16=True, fp16=True, paged_kv=True)

    def device_count(self) -> int:
        return device.device_count()

    def get_device_name(self, device_id: int = 0) -> str:
        return device.device_name(self.physical_device_id(device_id))

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return self.mem_get_info(device_id)[1]

    def mem_get_info(self, device_id: int = 0) -> tuple[int, int]:
        return device.memory_info(self.physical_device_id(device_id))

    def kv_cache_memory_budget(self, model_bytes: int, device_id: int = 0) -> int:
        # The stand-in's memory is the host's, shared with everything else: 512 MiB at most. A real
        # device can keep the default (90% of its free memory, less the weights).
        return min(super().kv_cache_memory_budget(model_bytes, device_id), 512 << 20)

    def check_and_update_config(self, config: Any) -> None:
        # Called once while the engine builds its config. The engine's default page is 16 tokens.
        if config.cache.block_size not in BLOCK_SIZES:
            config.cache.block_size = BLOCK_SIZES[0]

    def attention_backend_priority(self, requirements: Any) -> list[str]:
        # Our backend first; llmhal's pure-torch reference as the last resort.
        return ["mynpu_attn", "reference"]
'''

ATTENTION = '''\
"""mynpu_attn: what the backend supports, and where its implementation lives.

llmhal reads these declarations to choose a backend (and to explain why one does not fit) without
importing the implementation, which attention_impl.py holds.
"""

from typing import Any

from llmhal.attention import paged_kv
from llmhal.attention.backend import AttentionBackend
from mynpu.platform import BLOCK_SIZES


class MynpuAttentionBackend(AttentionBackend):
    name = "mynpu_attn"  # the same name as the key in MynpuPlatform.attention_backends
    supported_dtypes = ("float32", "bfloat16", "float16")
    supported_head_sizes = None  # None: any
    supported_block_sizes = BLOCK_SIZES
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")
    supports_sliding_window = True
    supports_logits_soft_cap = True

    @staticmethod
    def get_impl_cls() -> Any:
        from mynpu.attention_impl import MynpuAttentionImpl

        return MynpuAttentionImpl

    @staticmethod
    def get_builder_cls() -> Any:
        from mynpu.attention_impl import MynpuMetadataBuilder

        return MynpuMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: str = "auto",
    ) -> tuple[int, ...]:
        # The layout the reference kernels read; kernels of your own define theirs here.
        return paged_kv.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def availability(cls, platform: Any) -> list[str]:
        if platform.name != "mynpu":
            return [f"runs only on the mynpu platform (active: {platform.name})"]
        return []
'''

ATTENTION_IMPL = '''\
"""mynpu_attn's implementation and metadata builder, imported only when a model runs.

Both reuse llmhal's pure-torch reference kernels, so the package runs before it has kernels of its
own. Port forward() (and the metadata the builder prepares for it) to your runtime; the conformance
kit (pytest --llmhal-platform=mynpu) compares every change with the reference.
"""

from typing import Any

import torch

from llmhal.attention.reference import ReferenceAttentionImpl, ReferenceMetadataBuilder


class MynpuMetadataBuilder(ReferenceMetadataBuilder):
    """build(common) runs once per step and returns what forward() reads, for every layer."""


class MynpuAttentionImpl(ReferenceAttentionImpl):
    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:
        """Write this step's keys and values into the paged cache, then attend (the contract is
        llmhal.attention.backend.AttentionImpl)."""
        return super().forward(layer, query, key, value, kv_cache, attn_metadata)
'''

OPS = '''\
"""Custom-op kernels: each replaces the op of the same name in llmhal.ops.native (same signature)."""

from llmhal.ops import native


def rms_norm(x, weight, eps):
    # Call your runtime's kernel here; the conformance kit compares it with native.rms_norm.
    return native.rms_norm(x, weight, eps)
'''

TEST = '''\
"""llmhal's conformance suite on this platform: the checks pytest --llmhal-platform=mynpu runs."""

from llmhal.testing.platform_conformance import PlatformConformanceSuite
from mynpu import device, mynpu_platform_plugin
from mynpu.platform import MynpuPlatform


class TestMynpuConformance(PlatformConformanceSuite):
    platform_cls = MynpuPlatform
    probe = staticmethod(mynpu_platform_plugin)

    @classmethod
    def device_available(cls) -> bool:  # the live checks need the device
        return device.device_count() > 0
'''

README = """\
# mynpu: the llmhal platform for mynpu devices

Generated by `llmhal new-platform mynpu`. As generated, the "device" is a stand-in that computes on
the host CPU and the attention backend reuses llmhal's reference kernels: the package installs,
wins platform selection, passes the conformance kit and generates text. It is slow as generated
(llmhal's pure-torch kernels: the default model decodes several times slower than on the CPU
platform, and `llmhal generate` says which ops run them). Port it piece by piece, re-running the kit
after each step.

```bash
pip install -e .
llmhal doctor                    # Platform: mynpu, selected by: probe
pytest --llmhal-platform=mynpu   # the conformance kit (or: pytest tests)
llmhal generate --prompt "What is the capital of France?"
```

| file | what to change |
|---|---|
| `mynpu/device.py` | call your runtime: device count, name, memory |
| `mynpu/platform.py` | the torch device type, capabilities, the KV-cache budget |
| `mynpu/attention_impl.py` | your attention kernel and the metadata it reads |
| `mynpu/ops.py` | your kernels for llmhal's custom ops |

`MYNPU_VISIBLE_DEVICES=""` hides the device: llmhal then falls back to another platform and
`llmhal doctor` says why.
"""

FILES: dict[str, str] = {
    "pyproject.toml": PYPROJECT,
    "README.md": README,
    "mynpu/__init__.py": INIT,
    "mynpu/device.py": DEVICE,
    "mynpu/platform.py": PLATFORM,
    "mynpu/attention.py": ATTENTION,
    "mynpu/attention_impl.py": ATTENTION_IMPL,
    "mynpu/ops.py": OPS,
    "tests/test_mynpu_conformance.py": TEST,
}
