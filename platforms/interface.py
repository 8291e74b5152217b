"""The ``Platform`` contract: what a hardware vendor's package implements.

A platform is data plus a few hooks. Core never asks "is this CUDA?"; it reads the platform's
:class:`PlatformCapabilities`, its dtypes and memory figures, and the class paths it contributes
(attention backends, custom-op kernels, quantization methods). Everything heavy is imported lazily:
importing this module imports neither torch nor any vendor library, so an out-of-tree vendor can
``from llmhal.platforms import Platform`` at the top of its probe module.

Lifecycle: the resolver (``llmhal.platforms.resolver``) imports the class named by the winning probe,
checks :attr:`Platform.PLATFORM_API_VERSION`, and instantiates it with no arguments, once per process.
Hooks are then called by the engine: :meth:`Platform.check_and_update_config` while the engine config
is built, :meth:`Platform.verify_quantization` and :meth:`Platform.verify_dtype` before any weight loads.
"""

from __future__ import annotations

import contextlib
import os
import platform as _pyplatform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    import torch

# The version of this contract. A platform class states the version it was written for; the resolver
# accepts versions in SUPPORTED_PLATFORM_API_VERSIONS and rejects others with both numbers named.
PLATFORM_API_VERSION = 1
SUPPORTED_PLATFORM_API_VERSIONS = frozenset({1})


class PlatformUnavailable(Exception):
    """Raised by a probe to say "not available here" with a human-readable reason.

    Unlike any other exception from a probe, it is never an error, even for a plugin the user listed
    in ``VLLM_PLUGINS``: a missing device is an answer, a crashing probe is a bug.
    """


class PlatformNotUsableError(RuntimeError):
    """Something was asked of a platform that cannot provide it (e.g. the UnspecifiedPlatform)."""


class DeviceCapability(NamedTuple):
    """A device generation as ``major.minor`` (CUDA SM version; ROCm maps the gfx arch onto it)."""

    major: int
    minor: int

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"

    def to_int(self) -> int:
        if not 0 <= self.minor < 10:
            raise ValueError(f"minor version {self.minor} does not fit the 'major*10+minor' form")
        return self.major * 10 + self.minor


T = TypeVar("T")


class StepGraph(Protocol):
    """A recorded model step (see :meth:`Platform.capture_step_graph`)."""

    pool: Any  # memory another capture may share (Platform.capture_step_graph's pool=)

    def replay(self) -> None: ...


@dataclass(frozen=True)
class PlatformCapabilities:
    """What a platform can do, as data. Core code branches on these, never on the vendor.

    Attributes:
        bf16 / fp16: the dtype can be used for model weights and activations.
        fast_bf16_matmul: bf16 matmuls are at least as fast as fp32 (hardware bf16 dot products).
        fp8_storage: fp8 tensors can be stored and converted (fp8 KV cache, weight-only fp8).
        fp8_compute: fp8 matmuls run natively (``torch._scaled_mm``).
        paged_kv: the platform's attention backends support a paged KV cache.
        graphs: whole-step graph capture (CUDA graphs or an equivalent) is available.
        graph_chunk_tokens: prompt chunks of up to this many tokens may be recorded in a step
            graph beside decodes (0: only decodes and uniform draft verification are recorded).
            Set it only where every path such a step takes reads the step from the metadata's
            tensors, or refuses the capture (see :mod:`llmhal.engine.decode_graphs`).
        torch_compile: ``torch.compile`` works with :attr:`Platform.simple_compile_backend`.
        triton: Triton kernels can run on the device (not just in the interpreter).
        pinned_memory: host memory can be page-locked for async copies.
        unified_memory: host and device share memory (CPU, integrated GPUs).
    """

    bf16: bool = True
    fp16: bool = True
    fast_bf16_matmul: bool = False
    fp8_storage: bool = False
    fp8_compute: bool = False
    paged_kv: bool = True
    graphs: bool = False
    graph_chunk_tokens: int = 0
    torch_compile: bool = False
    triton: bool = False
    pinned_memory: bool = False
    unified_memory: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)


class Platform:
    """Base class of every platform. Subclasses set the class attributes and override the hooks.

    Class attributes (data; read without instantiating):
        name: short, lower-case platform name used in messages and ``VLLM_PLATFORM`` docs ("cpu").
        device_name: human-readable name of the device kind ("CPU", "NVIDIA GPU").
        device_type: the torch device type ("cpu", "cuda", "privateuseone").
        dist_backend: torch.distributed backend ("gloo", "nccl", ...).
        device_control_env_var: variable that restricts visible devices (None if there is none).
        priority: resolution priority; the highest available platform wins.
        is_fallback: True for a platform that is always available and should lose to any accelerator.
        attention_backends: backend name -> class path, the backends this platform provides on top of
            the hardware-neutral ones in core.
        op_kernels: custom-op name -> kernel path, overriding core's pure-torch implementation.
        quantization_methods: method name -> config class path, methods only this platform provides.
        supported_quantization: allow-list of quantization method names; None allows every method.
        device_communicator_cls: class path of the collective-communication wrapper (None = none).
    """

    PLATFORM_API_VERSION: ClassVar[int] = PLATFORM_API_VERSION

    name: ClassVar[str] = ""
    device_name: ClassVar[str] = ""
    device_type: ClassVar[str] = ""
    dispatch_key: ClassVar[str] = "CPU"
    dist_backend: ClassVar[str] = ""
    device_control_env_var: ClassVar[str | None] = None
    simple_compile_backend: ClassVar[str] = "inductor"
    priority: ClassVar[int] = 100
    is_fallback: ClassVar[bool] = False

    attention_backends: ClassVar[Mapping[str, str]] = {}
    op_kernels: ClassVar[Mapping[str, str]] = {}
    quantization_methods: ClassVar[Mapping[str, str]] = {}
    supported_quantization: ClassVar[Sequence[str] | None] = None
    device_communicator_cls: ClassVar[str | None] = None

    # ----------------------------------------------------------------------------------- data
    @property
    def capabilities(self) -> PlatformCapabilities:
        """The platform's capabilities; override to report what the device really supports."""
        return PlatformCapabilities()

    @property
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """Model dtypes this platform runs, preferred first (the first is the "auto" fallback)."""
        import torch

        caps = self.capabilities
        out = [torch.bfloat16] if caps.bf16 else []
        if caps.fp16:
            out.append(torch.float16)
        out.append(torch.float32)
        return tuple(out)

    def device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        """The device generation, or None where the notion does not apply (CPU)."""
        return None

    def has_device_capability(self, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        """True when the device is at least ``capability`` (a (major, minor) tuple or ``major*10+minor``)."""
        current = self.device_capability(device_id)
        if current is None:
            return False
        if isinstance(capability, int):
            return current.to_int() >= capability
        return tuple(current) >= tuple(capability)

    def device_count(self) -> int:
        return 1

    def get_device_name(self, device_id: int = 0) -> str:
        return self.device_name

    def get_device_total_memory(self, device_id: int = 0) -> int:
        """Total memory of the device in bytes."""
        raise NotImplementedError(f"platform {self.name!r} does not report device memory")

    def mem_get_info(self, device_id: int = 0) -> tuple[int, int]:
        """(free, total) device memory in bytes."""
        raise NotImplementedError(f"platform {self.name!r} does not report free memory")

    def kv_cache_memory_budget(self, model_bytes: int, device_id: int = 0) -> int:
        """Bytes the engine may give to the KV cache once ``model_bytes`` of weights are loaded.

        The default keeps 90% of the free memory minus the weights; platforms override it.
        """
        free, _total = self.mem_get_info(device_id)
        return max(0, int(free * 0.9) - model_bytes)

    def torch_device(self, device_id: int = 0) -> torch.device:
        import torch

        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, device_id)

    def physical_device_id(self, device_id: int) -> int:
        """Map a logical device index through ``device_control_env_var`` (identity if unset)."""
        var = self.device_control_env_var
        value = os.environ.get(var, "") if var else ""
        if not value:
            return device_id
        ids = [v.strip() for v in value.split(",") if v.strip()]
        if device_id >= len(ids):
            raise IndexError(f"device {device_id} is not visible: {var}={value!r}")
        return int(ids[device_id]) if ids[device_id].isdigit() else device_id

    @staticmethod
    def cpu_architecture() -> str:
        """x86, arm, powerpc, s390x, riscv, other or unknown."""
        machine = _pyplatform.machine().lower()
        if machine in ("x86_64", "amd64", "i386", "i686"):
            return "x86"
        for prefix, arch in (
            ("arm", "arm"),
            ("aarch", "arm"),
            ("ppc", "powerpc"),
            ("riscv", "riscv"),
        ):
            if machine.startswith(prefix):
                return arch
        if machine == "s390x":
            return "s390x"
        return "other" if machine else "unknown"

    # ------------------------------------------------------------------------- device control
    def seed(self, seed: int) -> None:
        """Seed every random generator the platform's kernels use."""
        import random

        import numpy as np
        import torch

        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.manual_seed(seed)

    def inference_mode(self) -> contextlib.AbstractContextManager[Any]:
        import torch

        return torch.inference_mode(True)

    def set_device(self, device: torch.device) -> None:
        """Make ``device`` current for this process (a no-op where there is one device)."""

    def synchronize(self, device_id: int = 0) -> None:
        """Wait for all queued work on the device (a no-op on synchronous devices)."""

    def is_pin_memory_available(self) -> bool:
        return self.capabilities.pinned_memory

    def capture_step_graph(
        self, run: Callable[[], T], pool: Any = None
    ) -> tuple[T, StepGraph | None, str | None]:
        """Run ``run()`` once (a model step on static buffers) and, where the platform can, record it.

        Returns ``(run's result, graph, reason)``: ``graph.replay()`` redoes the same work on the
        same buffers (the caller refills the inputs first; the result tensor is overwritten), or
        is None with ``reason`` saying why not. The result is the step's real one either way.
        ``pool`` is an earlier graph's ``graph.pool``: the new graph may share its memory (graphs
        sharing a pool never replay at once, as with CUDA graphs' ``pool=``). The default records
        nothing; CUDA-graph or native-call recorders override this (and set
        ``capabilities.graphs``).
        """
        return run(), None, f"the {self.name} platform does not record step graphs"

    # ---------------------------------------------------------------------- contributions
    def attention_backend_priority(self, requirements: Any) -> list[str]:
        """Backend names in preference order for ``requirements`` (an AttentionRequirements).

        The selector walks this list and takes the first backend whose ``validate`` is empty. The
        default prefers this platform's own backends, then the hardware-neutral ones.
        """
        return [*self.attention_backends, "flex_attention", "triton_attn", "reference"]

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        """Class path of the communicator the parallel layers' collectives go through (vLLM's
        name): ``device_communicator_cls`` when the platform sets one, else core's
        ``DeviceCommunicatorBase`` over ``torch.distributed`` on ``dist_backend``. Read once per
        process group by ``llmhal.distributed.init_distributed``."""
        return cls.device_communicator_cls or (
            "llmhal.distributed.communicator:DeviceCommunicatorBase"
        )

    # ------------------------------------------------------------------------------- hooks
    def check_and_update_config(self, config: Any) -> None:
        """Called once while the engine config is built; may adjust it in place or raise."""

    def verify_quantization(self, method: str) -> None:
        """Raise ValueError when ``method`` is not allowed on this platform."""
        allowed = self.supported_quantization
        if allowed is not None and method not in allowed:
            raise ValueError(
                f"Quantization method {method!r} is not supported on the {self.name} platform. "
                f"Supported here: {', '.join(allowed) or 'none'}."
            )

    def verify_dtype(self, dtype: torch.dtype) -> None:
        """Raise ValueError when ``dtype`` cannot be used for the model on this platform."""
        if dtype not in self.supported_dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.supported_dtypes)
            raise ValueError(
                f"dtype {str(dtype).removeprefix('torch.')} is not supported on the {self.name} "
                f"platform ({self.get_device_name()}); use one of: {names}"
            )

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for ``llmhal doctor``."""
        caps = self.capabilities
        cap = self.device_capability()
        return {
            "name": self.name,
            "device_name": self.get_device_name(),
            "device_type": self.device_type,
            "dist_backend": self.dist_backend,
            "device_count": self.device_count(),
            "device_capability": cap.as_version_str() if cap else None,
            "supported_dtypes": [str(d).removeprefix("torch.") for d in self.supported_dtypes],
            "capabilities": {k: v for k, v in caps.__dict__.items() if k != "extra"}
            | dict(caps.extra),
        }

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class UnspecifiedPlatform(Platform):
    """Stands in when no platform is available. Every real use raises with the remedy."""

    name = "unspecified"
    device_name = "no platform"
    device_type = ""
    priority = -1

    INSTALL_REMEDY = (
        "Install one, e.g. `pip install llmhal[cpu]` (or llmhal[cuda], llmhal[rocm]), and check "
        "`llmhal doctor`."
    )

    def __init__(
        self, reason: str = "no platform package is installed", remedy: str | None = None
    ) -> None:
        self.reason = reason
        self.remedy = self.INSTALL_REMEDY if remedy is None else remedy

    def _fail(self, what: str) -> PlatformNotUsableError:
        # The cause first: "install llmhal[cpu]" misleads when cpu is installed but excluded.
        remedy = f" {self.remedy}" if self.remedy else ""
        return PlatformNotUsableError(
            f"No llmhal platform is active: {self.reason}. llmhal cannot {what} without one.{remedy}"
        )

    @property
    def capabilities(self) -> PlatformCapabilities:
        return PlatformCapabilities(bf16=False, fp16=False, paged_kv=False)

    @property
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        raise self._fail("choose a dtype")

    def device_count(self) -> int:
        return 0

    def mem_get_info(self, device_id: int = 0) -> tuple[int, int]:
        raise self._fail("query device memory")

    def get_device_total_memory(self, device_id: int = 0) -> int:
        raise self._fail("query device memory")

    def torch_device(self, device_id: int = 0) -> torch.device:
        raise self._fail("place tensors on a device")

    def attention_backend_priority(self, requirements: Any) -> list[str]:
        raise self._fail("select an attention backend")

    def check_and_update_config(self, config: Any) -> None:
        raise self._fail("run a model")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "device_name": self.device_name, "reason": self.reason}


def platform_probe(class_path: str, *, name: str | None = None) -> Any:
    """Decorate a probe to declare the class it returns when available, and its platform's name.

    Declaring the class lets llmhal list what an installed-but-inactive platform would provide (its
    attention backends, quantization methods) in ``llmhal doctor`` and in error messages. Declaring
    ``name`` (the class's ``Platform.name``) lets ``VLLM_PLATFORM=<name>`` select the platform when
    its entry point is named otherwise, without calling any other probe. The probe still returns the
    class path or None (vLLM's convention), or raises :class:`PlatformUnavailable`.
    """

    def deco(fn: Any) -> Any:
        fn.llmhal_platform_class = class_path
        fn.llmhal_platform_name = name
        return fn

    return deco
