"""CpuPlatform: always available, lowest priority (any accelerator beats it)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from llmhal.logger import init_logger
from llmhal.platforms import Platform, PlatformCapabilities, StepGraph
from llmhal_cpu import cpuinfo

logger = init_logger(__name__)
T = TypeVar("T")

GiB = 1 << 30


class CpuPlatform(Platform):
    PLATFORM_API_VERSION = 1

    name = "cpu"
    device_name = "CPU"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"
    device_control_env_var = None
    priority = 0
    is_fallback = True

    attention_backends: ClassVar[dict[str, str]] = {
        "cpu_attn": "llmhal_cpu.attention.cpu_attn:CpuAttentionBackend",
        "cpu_mla": "llmhal_cpu.attention.cpu_mla:CpuMLABackend",
    }
    op_kernels: ClassVar[dict[str, str]] = {
        "rms_norm": "llmhal_cpu.ops:rms_norm",
        "fused_add_rms_norm": "llmhal_cpu.ops:fused_add_rms_norm",
        "rotary_embedding": "llmhal_cpu.ops:rotary_embedding",
        "silu_and_mul": "llmhal_cpu.ops:silu_and_mul",
        "quant_linear": "llmhal_cpu.kernels.quant_linear:CpuQuantLinear",
        "dense_linear": "llmhal_cpu.kernels.dense_linear:prepare",
        "fused_moe": "llmhal_cpu.moe:fused_moe",
        "router_logits": "llmhal_cpu.moe:router_logits",
        "causal_conv1d_fn": "llmhal_cpu.mamba_kernels:causal_conv1d_fn",
        "causal_conv1d_update": "llmhal_cpu.mamba_kernels:causal_conv1d_update",
        "selective_scan_varlen": "llmhal_cpu.mamba_kernels:selective_scan_varlen",
        "selective_state_update": "llmhal_cpu.mamba_kernels:selective_state_update",
        "ssd_chunk_scan_varlen": "llmhal_cpu.mamba_kernels:ssd_chunk_scan_varlen",
        "gated_rms_norm": "llmhal_cpu.mamba_kernels:gated_rms_norm",
        "lightning_attn_decode": "llmhal_cpu.mamba_kernels:lightning_attn_decode",
    }
    # None: every registered method may run here (each checks its own needs in validate()).
    supported_quantization = None
    # The state dtypes mamba_kernels.py reads and writes natively (float16 would run only in core's
    # slow reference, so mamba_cache_dtype / mamba_ssm_cache_dtype refuse it here).
    supported_mamba_cache_dtypes = ("float32", "bfloat16")

    @property
    def capabilities(self) -> PlatformCapabilities:
        flags = cpuinfo.cpu_flags()
        # Hardware bf16 dot products: AVX512-BF16 or AMX on x86, the bf16 extension on Arm.
        fast_bf16 = bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
        return PlatformCapabilities(
            bf16=True,
            fp16=True,
            fast_bf16_matmul=fast_bf16,
            fp8_storage=True,
            fp8_compute=False,
            paged_kv=True,
            graphs=True,  # native-call step graphs (step_graph.py)
            # cpu_attn.KERNEL_MAX_QUERY_LEN (not imported: that loads torch): query runs this
            # short go to the paged kernel, which reads the step from the metadata's tensors; a
            # longer one takes torch's prefill path, which step_graph's guard refuses to record.
            graph_chunk_tokens=8,
            torch_compile=True,
            triton=False,
            pinned_memory=False,
            unified_memory=True,
            extra={
                "isa": sorted(
                    flags
                    & {
                        "avx2",
                        "fma",
                        "avx512f",
                        "avx512_bf16",
                        "avx512_vnni",
                        "amx_bf16",
                        "amx_int8",
                        "neon",
                        "asimd",
                        "sve",
                    }
                ),
                "cores": cpuinfo.usable_cores(),
            },
        )

    def get_device_name(self, device_id: int = 0) -> str:
        return cpuinfo.cpu_model_name()

    def device_count(self) -> int:
        return 1

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return cpuinfo.total_memory()

    def mem_get_info(self, device_id: int = 0) -> tuple[int, int]:
        return cpuinfo.available_memory(), cpuinfo.total_memory()

    def kv_cache_memory_budget(self, model_bytes: int, device_id: int = 0) -> int:
        """``LLMHAL_CPU_KVCACHE_SPACE`` GiB if set, else half the available memory capped at 4 GiB.

        The weights are already resident when this is asked, so available memory excludes them.
        """
        raw = os.environ.get("LLMHAL_CPU_KVCACHE_SPACE")
        if raw:
            try:
                return int(float(raw) * GiB)
            except ValueError:
                raise ValueError(
                    f"LLMHAL_CPU_KVCACHE_SPACE={raw!r} is not a number of GiB (e.g. 2 or 0.5)"
                ) from None
        return int(min(4 * GiB, cpuinfo.available_memory() * 0.5))

    def attention_backend_priority(self, requirements: Any) -> list[str]:
        if requirements.kind == "mla":  # core's MLA backends follow as the unranked ones
            return ["cpu_mla"]
        return ["cpu_attn", "flex_attention", "reference"]

    def capture_step_graph(
        self, run: Callable[[], T], pool: Any = None
    ) -> tuple[T, StepGraph | None, str | None]:
        """Records the step's native kernel calls (see :mod:`llmhal_cpu.step_graph`)."""
        from llmhal_cpu import step_graph

        return step_graph.capture(run, pool)

    def check_and_update_config(self, config: Any) -> None:
        threads = os.environ.get("LLMHAL_NUM_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))
