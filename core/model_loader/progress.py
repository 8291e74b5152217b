"""What loading a model is doing, on one rewritten stderr line.

Loading a model takes seconds, most of them before a single tensor is read (on a 2-core machine
the default model spent ~3 s of ~5.5 s importing transformers' config class and converting its
tokenizer, before llmhal avoided both; importing transformers itself still takes ~1 s), so a
tensor counter alone appeared only for the last fraction of a second. :class:`LoadProgress` names
each stage as it starts (config, tokenizer, weights with a tensor count, preparing kernels, KV
cache) and ends with one line saying what was loaded and how long it took.

It writes only when enabled: by default when stderr is a terminal, so logs, pipes and tests stay
clean. Nothing here uses tqdm: one line rewritten with ``\\r`` works on every terminal and adds no
dependency.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

# Rewriting the line for every tensor of a large checkpoint costs more than the tensor itself
# when the tensor is a memory-mapped view; redraw at most this often (the last count always shows).
_REDRAW_S = 0.1


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class LoadProgress:
    """Stages of loading ``name`` on stderr; every method is a no-op when disabled."""

    def __init__(self, name: str, enabled: bool | None = None) -> None:
        self.name = name
        self.enabled = stderr_is_terminal() if enabled is None else enabled
        self._t0 = time.perf_counter()
        self._width = 0
        self._drawn = 0.0

    def _draw(self, text: str, end: str = "") -> None:
        line = f"Loading {self.name}: {text}" if not end else text
        # Pad over what the previous, longer line left on screen.
        sys.stderr.write("\r" + line.ljust(self._width) + end)
        sys.stderr.flush()
        self._width = 0 if end else len(line)
        self._drawn = time.perf_counter()

    def stage(self, text: str) -> None:
        """Say that ``text`` (e.g. "tokenizer") starts now."""
        if self.enabled:
            self._draw(text + " ...")

    def tensors(self, items: Iterable[T], total: int | None, what: str = "weights") -> Iterator[T]:
        """Yield ``items`` unchanged, counting them on the line as ``what k/total``."""
        if not self.enabled:
            yield from items
            return
        of = f"/{total}" if total else ""
        done = 0
        self._draw(f"{what} 0{of} tensors")
        for item in items:
            yield item
            done += 1
            if time.perf_counter() - self._drawn >= _REDRAW_S:
                self._draw(f"{what} {done}{of} tensors")
        self._draw(f"{what} {done}{of} tensors")

    def finish(self, detail: str = "") -> None:
        """End the line with what was loaded and the time since the start."""
        if self.enabled:
            took = time.perf_counter() - self._t0
            self._draw(
                f"Loaded {self.name}{' (' + detail + ')' if detail else ''} in {took:.1f} s", "\n"
            )

    def abandon(self) -> None:
        """Clear the line (loading failed: the error that follows should start on a clean line)."""
        if self.enabled and self._width:
            sys.stderr.write("\r" + " " * self._width + "\r")
            sys.stderr.flush()
            self._width = 0
