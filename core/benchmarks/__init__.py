"""Benchmarks, run as `llmhal bench <name>` or `python -m llmhal.benchmarks.<name>`."""
