"""RocmPlatform: AMD GPUs, detected through amdsmi, run through PyTorch's ROCm build (HIP).

Importing this module imports neither torch nor amdsmi. PyTorch exposes HIP devices under the
``"cuda"`` device type, so ``torch.cuda`` calls (inside methods only) drive the device; RCCL serves the
``"nccl"`` distributed backend.

AITER: AMD's aiter kernels are opt-in with ``VLLM_ROCM_USE_AITER=1`` (they compile on first use,
which takes minutes). When opted in, installed and supported by the arch (gfx942, gfx950),
``rocm_aiter_fa`` comes first in the attention priority; otherwise rocm_attn leads.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, ClassVar

from llmhal.logger import init_logger
from llmhal.platforms import AcceleratorPlatform, PlatformCapabilities
from llmhal.utils.imports import is_available
from llmhal_rocm import arch as gfx
from llmhal_rocm import libraries, visibility
from llmhal_rocm.detect import RocmDevice, RocmInventory, amdsmi_session, detect_rocm, vram_bytes

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = init_logger(__name__)

AITER_ENV = "VLLM_ROCM_USE_AITER"


def aiter_enabled() -> bool:
    """True when the user opted into AMD aiter kernels (``VLLM_ROCM_USE_AITER=1``/``true``)."""
    return os.environ.get(AITER_ENV, "0").strip().lower() in ("1", "true")


class RocmPlatform(AcceleratorPlatform[RocmInventory]):
    """AMD Instinct/Radeon GPUs. ``inventory`` may be injected; otherwise amdsmi is asked on first
    use. Device facts, the KV-cache budget, seeding and synchronisation follow
    :class:`~llmhal.platforms.AcceleratorPlatform` (torch's ``cuda`` module drives HIP devices)."""

    PLATFORM_API_VERSION = 1

    name = "rocm"
    device_name = "AMD GPU"
    device_label = "ROCm"
    device_type = "cuda"  # PyTorch's ROCm build names HIP devices "cuda"
    dispatch_key = "CUDA"
    dist_backend = "nccl"  # RCCL behind torch's nccl backend
    device_control_env_var = visibility.ENV_VAR
    simple_compile_backend = "inductor"
    priority = 100
    is_fallback = False

    attention_backends: ClassVar[dict[str, str]] = {
        "rocm_attn": "llmhal_rocm.attention.rocm_attn:RocmAttentionBackend",
        "rocm_aiter_fa": "llmhal_rocm.attention.rocm_aiter_fa:AiterFlashAttentionBackend",
    }
    quantization_methods: ClassVar[dict[str, str]] = {}
    # Methods whose kernels run on ROCm: pure-torch/Triton ones from core. CUDA-only kernels
    # (Marlin, FBGEMM, ModelOpt/NVFP4) are absent on purpose.
    supported_quantization: ClassVar[tuple[str, ...]] = (
        "gguf",
        "fp8",
        "compressed-tensors",
        "gptq",
        "awq",
        "bitsandbytes",
    )

    # ------------------------------------------------------------------------------ devices
    def detect(self) -> RocmInventory:
        return detect_rocm()

    def visible_devices(self) -> list[RocmDevice]:
        return visibility.visible_devices(self.inventory.devices)

    def visibility_note(self) -> str:
        return (
            f"{visibility.ROCR_VAR}={os.environ.get(visibility.ROCR_VAR)!r}, "
            f"{visibility.ENV_VAR}={visibility.hip_visible_value()!r}"
        )

    def gcn_arch(self, device_id: int = 0) -> str:
        """The device's architecture name, e.g. ``"gfx942"``."""
        return self.device_record(device_id).arch

    def mem_get_info(self, device_id: int = 0) -> tuple[int, int]:
        """(free, total) VRAM bytes of the whole device, as amdsmi sees it."""
        physical = self.physical_device_id(device_id)
        with amdsmi_session() as smi:
            handle = list(smi.amdsmi_get_processor_handles())[physical]
            total, used = vram_bytes(smi, handle)
        return max(0, total - used), total

    # ---------------------------------------------------------------------------------- data
    def _archs(self) -> list[str]:
        return [d.arch for d in self.visible_devices()]

    @property
    def capabilities(self) -> PlatformCapabilities:
        archs = self._archs()
        # Mixed GPUs in one process must share features: every visible one must have it.
        every = lambda pred: bool(archs) and all(pred(a) for a in archs)  # noqa: E731
        triton = is_available("triton") and every(gfx.supports_triton)
        fnuz = every(gfx.is_fp8_fnuz)
        return PlatformCapabilities(
            bf16=True,
            fp16=True,
            fast_bf16_matmul=every(gfx.has_fast_bf16),
            fp8_storage=True,
            fp8_compute=every(gfx.has_fp8_compute),
            paged_kv=True,
            graphs=True,
            torch_compile=triton,
            triton=triton,
            pinned_memory=True,
            unified_memory=False,
            extra={
                "gcn_arch": ",".join(sorted(set(archs))),
                "fp8_fnuz": fnuz,
                "fp8_dtype": "float8_e4m3fnuz" if fnuz else "float8_e4m3fn",
                "aiter": aiter_enabled()
                and every(gfx.supports_aiter)
                and libraries.aiter_reason() is None,
                "driver_version": self.inventory.driver_version,
            },
        )

    def is_fp8_fnuz(self) -> bool:
        """True on CDNA3 (gfx94x), whose fp8 matmuls take the fnuz formats."""
        return bool(self.capabilities.extra["fp8_fnuz"])

    def fp8_dtype(self) -> torch.dtype:
        """e4m3fnuz on gfx94x, OCP e4m3fn elsewhere (gfx950, RDNA4)."""
        import torch

        return torch.float8_e4m3fnuz if self.is_fp8_fnuz() else torch.float8_e4m3fn

    # ------------------------------------------------------------------------- contributions
    def attention_backend_priority(self, requirements: Any) -> list[str]:
        """rocm_attn, then triton_attn and flex_attention; rocm_aiter_fa leads when opted in."""
        if requirements.kind == "tree":
            return ["tree_attn"]
        order = ["rocm_attn", "triton_attn", "flex_attention"]
        if aiter_enabled():
            order.insert(0, "rocm_aiter_fa")
        return order

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["driver_version"] = self.inventory.driver_version
        out["devices"] = [
            {
                "index": d.index,
                "name": d.name,
                "arch": d.arch,
                "capability": d.capability.as_version_str(),
                "total_memory": d.total_memory,
            }
            for d in self.visible_devices()
        ]
        return out
