"""Quantization methods that need NVIDIA GPUs (declared in ``CudaPlatform.quantization_methods``)."""
