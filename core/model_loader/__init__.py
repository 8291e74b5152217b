"""Checkpoint loading: safetensors folders and GGUF files."""
