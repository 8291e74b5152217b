"""The ``llmhal`` command: ``doctor``, ``generate``, ``serve``, ``bench <what>``, ``new-platform``
and ``warmup``.

This module stays cheap to import (no torch) so ``llmhal --help`` is instant. Each subcommand lives in
its own module with a ``main(argv) -> int | None``; the arguments after the subcommand are passed on
untouched, so ``llmhal generate --help`` shows the generator's own options. A subcommand whose module
is not part of this build exits with status 2 and says so.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("llmhal.doctor", "show plugins, the selected platform and what works here"),
    "generate": ("llmhal.entrypoints.generate", "generate text from a prompt"),
    "serve": ("llmhal.entrypoints.serve", "run the OpenAI-compatible HTTP server"),
    "bench": ("llmhal.benchmarks", "run a benchmark: llmhal bench <what> [options]"),
    "warmup": (
        "llmhal.entrypoints.warmup",
        "build what the first run would (the platform's kernels) now; ci/setup runs it",
    ),
    "new-platform": (
        "llmhal.entrypoints.new_platform",
        "write a complete platform package to start a port from",
    ),
}
BENCHMARKS_PACKAGE = "llmhal.benchmarks"
_BENCH_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def _usage() -> str:
    from llmhal import __version__

    width = max(map(len, COMMANDS))
    lines = [
        f"usage: llmhal <command> [options]   (llmhal {__version__})",
        "",
        "LLM inference on any installed hardware platform.",
        "",
        "commands:",
        *(f"  {name.ljust(width)}  {text}" for name, (_, text) in COMMANDS.items()),
        "",
        "Run `llmhal <command> --help` for a command's options.",
    ]
    return "\n".join(lines)


def _fail(message: str, code: int = 2) -> int:
    print(f"llmhal: error: {message}", file=sys.stderr)
    return code


def _module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def _run(module: str, argv: list[str], what: str) -> int:
    if not _module_exists(module):
        return _fail(
            f"`llmhal {what}` is not available in this build (module {module} is not installed); "
            f"see `llmhal --help` for the commands this build has."
        )
    entry = getattr(importlib.import_module(module), "main", None)
    if entry is None:
        return _fail(f"`llmhal {what}` is not available in this build ({module} has no main()).")
    result = entry(argv)
    return int(result or 0)


def available_benchmarks() -> list[str]:
    """Benchmark modules in :mod:`llmhal.benchmarks`, found without importing them."""
    package = importlib.import_module(BENCHMARKS_PACKAGE)
    return sorted(
        m.name
        for m in pkgutil.iter_modules(package.__path__)
        if not m.name.startswith("_") and not m.ispkg
    )


def _bench(argv: list[str]) -> int:
    names = available_benchmarks()
    listing = ", ".join(names) or "none in this build"
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: llmhal bench <what> [options]\n\nbenchmarks: {listing}")
        return 0 if argv else 2
    what = argv[0]
    if not _BENCH_NAME.match(what) or what not in names:
        return _fail(
            f"benchmark {what!r} is not available in this build; available benchmarks: {listing}"
        )
    return _run(f"{BENCHMARKS_PACKAGE}.{what}", argv[1:], f"bench {what}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``llmhal`` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from llmhal import __version__

        print(f"llmhal {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command == "bench":
        return _bench(rest)
    if command not in COMMANDS:
        return _fail(f"unknown command {command!r}; commands: {', '.join(COMMANDS)}")
    return _run(COMMANDS[command][0], rest, command)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
