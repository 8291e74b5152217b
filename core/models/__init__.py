"""Model architectures, registered by HF architecture name (see ``registry.py``)."""
