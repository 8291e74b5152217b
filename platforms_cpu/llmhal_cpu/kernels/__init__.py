"""CPU kernels registered through ``CpuPlatform.op_kernels`` (imported only when an op resolves)."""
