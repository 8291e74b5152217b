"""Fakes of vendor libraries that accept exactly what the real entry points accept.

A fake written as ``def f(q, k, v, *args, **kw)`` takes any call, so a wrong keyword or an argument
in the wrong position passes on a CPU and fails (or silently means something else) on a GPU.
:func:`bound_to` checks every call against a transcription of the upstream signature and hands
the fake the bound arguments, defaults applied, so it reads each one by its upstream name.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any


def bind(signature_of: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The call's arguments by upstream name (defaults filled in); TypeError as the real one would
    raise for a call its signature refuses."""
    sig = inspect.signature(signature_of)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{signature_of.__qualname__}{sig}: {e}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def bound_to(
    signature_of: Callable[..., Any],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a fake ``impl(arguments: dict)`` so that it is called like ``signature_of``."""

    def wrap(impl: Callable[[dict[str, Any]], Any]) -> Callable[..., Any]:
        @functools.wraps(signature_of)
        def fake(*args: Any, **kwargs: Any) -> Any:
            return impl(bind(signature_of, *args, **kwargs))

        return fake

    return wrap


def signature_drift(ours: Callable[..., Any], real: Callable[..., Any]) -> list[str]:
    """How the installed library's ``real`` entry point differs from the transcription ``ours``
    in ways that break llmhal's calls: a parameter llmhal may pass that ``real`` lacks (unless it
    takes ``**kwargs``), or a positional parameter at another position. Empty: compatible."""
    mine = list(inspect.signature(ours).parameters.values())
    theirs = inspect.signature(real).parameters
    names = list(theirs)
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in theirs.values())
    problems = []
    for i, p in enumerate(mine):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name not in theirs:
            if not takes_kwargs:
                problems.append(f"no parameter {p.name!r}")
            continue
        if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty and names.index(p.name) != i:
            problems.append(f"{p.name!r} is positional {names.index(p.name)}, expected {i}")
    return problems
