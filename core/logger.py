"""The ``llmhal`` logger tree. Configured once, on first use, from ``LLMHAL_LOGGING_LEVEL``."""

from __future__ import annotations

import logging
import os
import sys
import threading

_lock = threading.Lock()
_configured = False


def _configure_root() -> None:
    global _configured
    with _lock:
        if _configured:
            return
        root = logging.getLogger("llmhal")
        level = os.environ.get("LLMHAL_LOGGING_LEVEL", "WARNING").upper()
        root.setLevel(getattr(logging, level, logging.WARNING))
        if not root.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            root.addHandler(handler)
        _configured = True


def init_logger(name: str) -> logging.Logger:
    """Return a logger under the ``llmhal`` tree (``name`` is usually ``__name__``)."""
    _configure_root()
    # Platform packages (llmhal_cpu, llmhal_cuda, a vendor's) join the tree too: a bare prefix test
    # left "llmhal_cpu.*" outside it, so LLMHAL_LOGGING_LEVEL never reached their messages.
    if name != "llmhal" and not name.startswith("llmhal."):
        name = f"llmhal.{name}"
    return logging.getLogger(name)
