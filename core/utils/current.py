"""``Current``: a per-thread "current X" that a ``with`` block sets and the code inside reads.

The engine config while a model is built, the forward context during a step: code deep inside a
model reads them without threading them through every signature. Nested blocks restore the outer
value on exit, and another thread never sees this thread's value.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Current(Generic[T]):
    """One per-thread slot. ``missing`` is the RuntimeError text :meth:`get` raises outside a
    :meth:`using` block (say where the value comes from)."""

    def __init__(self, missing: str) -> None:
        self._local = threading.local()
        self._missing = missing

    @contextlib.contextmanager
    def using(self, value: T) -> Iterator[T]:
        """Make ``value`` current in this thread for the block (the previous one comes back)."""
        prev = getattr(self._local, "value", None)
        self._local.value = value
        try:
            yield value
        finally:
            self._local.value = prev

    def get(self) -> T:
        """The current value; RuntimeError with the ``missing`` text when none is set."""
        value: T | None = getattr(self._local, "value", None)
        if value is None:
            raise RuntimeError(self._missing)
        return value
