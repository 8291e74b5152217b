"""CudaPlatform: NVIDIA GPUs, detected through NVML (Jetson: Tegra markers, details from torch).

Importing this module imports neither torch nor pynvml. Device facts (names, compute capability,
memory) come from NVML where it exists, so querying them never creates a CUDA context; ``torch.cuda``
is used only for what needs the runtime (set_device, synchronize, seeding) and on Jetson, which has
no NVML.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, ClassVar

from llmhal.logger import init_logger
from llmhal.platforms import AcceleratorPlatform, DeviceCapability, PlatformCapabilities
from llmhal.utils.imports import is_available
from llmhal_cuda import libraries, visibility
from llmhal_cuda.detect import JETSON, CudaDevice, CudaInventory, detect_cuda, nvml_session

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = init_logger(__name__)

# Backends in preference order (names are case-insensitive; unknown ones are skipped by the selector).
_BLACKWELL_ORDER = ("flashinfer", "flash_attn", "triton_attn", "flex_attention")
_DEFAULT_ORDER = ("flash_attn", "flashinfer", "triton_attn", "flex_attention")


@functools.cache
def _is_wsl() -> bool:
    # Pinned host memory is unreliable under WSL (the driver maps it through the host).
    try:
        with open("/proc/version") as f:
            return "microsoft" in f.read().lower()
    except OSError:
        return False


class CudaPlatform(AcceleratorPlatform[CudaInventory]):
    """NVIDIA GPUs. ``inventory`` (what detection found) may be injected; otherwise NVML is asked
    on first use. Device facts, the KV-cache budget, seeding and synchronisation follow
    :class:`~llmhal.platforms.AcceleratorPlatform`; on Jetson (no NVML) torch reports the facts."""

    PLATFORM_API_VERSION = 1

    name = "cuda"
    device_name = "NVIDIA GPU"
    device_label = "CUDA"
    device_type = "cuda"
    dispatch_key = "CUDA"
    dist_backend = "nccl"
    device_control_env_var = visibility.ENV_VAR
    simple_compile_backend = "inductor"
    priority = 100
    is_fallback = False

    attention_backends: ClassVar[dict[str, str]] = {
        "flash_attn": "llmhal_cuda.attention.flash_attn:FlashAttentionBackend",
        "flashinfer": "llmhal_cuda.attention.flashinfer:FlashInferBackend",
        "flashmla": "llmhal_cuda.attention.flashmla:FlashMLABackend",
    }
    # FlashInfer's CUTLASS fused-MoE kernel where usable; core's grouped implementation otherwise.
    op_kernels: ClassVar[dict[str, str]] = {"fused_moe": "llmhal_cuda.moe:fused_moe"}
    quantization_methods: ClassVar[dict[str, str]] = {
        "fbgemm_fp8": "llmhal_cuda.quantization.fbgemm_fp8:FBGEMMFp8Config",
        "modelopt": "llmhal_cuda.quantization.modelopt:ModelOptConfig",
        "gptq_marlin": "llmhal_cuda.quantization.gptq_marlin:GPTQMarlinConfig",
        "awq_marlin": "llmhal_cuda.quantization.awq_marlin:AWQMarlinConfig",
    }
    # None: every registered method may run; each one checks the capability it needs.
    supported_quantization = None

    # ------------------------------------------------------------------------------ devices
    def detect(self) -> CudaInventory:
        inventory = detect_cuda()
        self._cuda_uuids = visibility.pin_device_order(inventory.devices)
        return inventory

    @property
    def is_jetson(self) -> bool:
        return self.inventory.source == JETSON

    def visible_devices(self) -> list[CudaDevice]:
        """The NVML devices this process sees, in logical order (empty on Jetson)."""
        inv = self.inventory
        by_index = {d.index: d for d in inv.devices}
        order = visibility.visible_indices(
            os.environ.get(visibility.ENV_VAR),
            inv.devices,
            getattr(self, "_cuda_uuids", None),
        )
        return [by_index[i] for i in order]

    def device_count(self) -> int:
        if self.is_jetson:
            import torch

            return torch.cuda.device_count()
        return super().device_count()

    def physical_device_id(self, device_id: int) -> int:
        if self.is_jetson:
            return device_id
        return super().physical_device_id(device_id)

    def device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        if self.is_jetson:
            import torch

            return DeviceCapability(*torch.cuda.get_device_capability(device_id))
        return super().device_capability(device_id)

    def get_device_name(self, device_id: int = 0) -> str:
        if self.is_jetson:
            import torch

            return torch.cuda.get_device_name(device_id)
        return super().get_device_name(device_id)

    def get_device_uuid(self, device_id: int = 0) -> str:
        if self.is_jetson:
            import torch

            return str(torch.cuda.get_device_properties(device_id).uuid)
        return super().get_device_uuid(device_id)

    def get_device_total_memory(self, device_id: int = 0) -> int:
        if self.is_jetson:
            import torch

            return int(torch.cuda.get_device_properties(device_id).total_memory)
        return super().get_device_total_memory(device_id)

    def mem_get_info(self, device_id: int = 0) -> tuple[int, int]:
        """(free, total) bytes of the whole device, as NVML sees it (every process counted)."""
        if self.is_jetson:
            import torch

            free, total = torch.cuda.mem_get_info(device_id)
            return int(free), int(total)
        physical = self.physical_device_id(device_id)
        with nvml_session() as nvml:
            info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(physical))
        return int(info.free), int(info.total)

    # ---------------------------------------------------------------------------------- data
    def _min_capability(self) -> DeviceCapability:
        if self.is_jetson:
            cap = self.device_capability(0)
            assert cap is not None
            return cap
        devices = self.visible_devices()
        if not devices:
            return DeviceCapability(0, 0)
        # Mixed GPUs in one process must share features: the oldest one decides.
        return min(d.capability for d in devices)

    @property
    def capabilities(self) -> PlatformCapabilities:
        cap = self._min_capability()
        triton = is_available("triton") and cap >= (7, 5)
        inv = self.inventory
        return PlatformCapabilities(
            bf16=cap >= (8, 0),
            fp16=cap >= (6, 0),
            fast_bf16_matmul=cap >= (8, 0),
            fp8_storage=True,
            fp8_compute=cap >= (8, 9),
            paged_kv=True,
            graphs=True,
            torch_compile=triton,
            triton=triton,
            pinned_memory=not _is_wsl(),
            unified_memory=self.is_jetson,
            extra={
                "compute_capability": cap.as_version_str(),
                "detection": inv.source,
                "driver_version": inv.driver_version,
                "fp8_dtype": "float8_e4m3fn",
            },
        )

    def fp8_dtype(self) -> torch.dtype:
        """The fp8 format of this device's fp8 matmuls (OCP e4m3fn on every NVIDIA GPU)."""
        import torch

        return torch.float8_e4m3fn

    def verify_dtype(self, dtype: torch.dtype) -> None:
        try:
            super().verify_dtype(dtype)
        except ValueError as e:
            cap = self._min_capability()
            raise ValueError(
                f"{e} (compute capability {cap.as_version_str()}: bfloat16 needs >= 8.0, float16 "
                f">= 6.0; pass dtype=float16 or float32)"
            ) from None

    # ------------------------------------------------------------------------- contributions
    def attention_backend_priority(self, requirements: Any) -> list[str]:
        """Blackwell (10.x) prefers FlashInfer; every other generation FlashAttention; MLA layers
        FlashMLA.

        fp32 models reach triton_attn/flex_attention because flash_attn and flashinfer reject fp32
        in ``validate``; tree-shaped (speculative) batches get tree_attn.
        """
        if requirements.kind == "tree":
            return ["tree_attn"]
        if requirements.kind == "mla":
            # FlashMLA where it applies (64-token pages, 16-bit, Hopper/Blackwell); core's MLA
            # backends follow as the selector's unranked ones.
            return ["flashmla"]
        cap = requirements.device_capability or self.device_capability()
        order = _BLACKWELL_ORDER if cap is not None and cap[0] == 10 else _DEFAULT_ORDER
        return list(order)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        inv = self.inventory
        out["detection"] = inv.source
        if inv.jetson_marker:
            out["jetson_marker"] = inv.jetson_marker
        out["driver_version"] = inv.driver_version
        out["libraries"] = libraries.summary()
        out["devices"] = [
            {
                "index": d.index,
                "name": d.name,
                "capability": d.capability.as_version_str(),
                "total_memory": d.total_memory,
            }
            for d in self.visible_devices()
        ]
        return out
