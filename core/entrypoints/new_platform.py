"""``llmhal new-platform NAME``: write a complete, installable platform package to start from.

The package (files in :mod:`llmhal.entrypoints.platform_template`) has a probe, a ``Platform``
subclass, one attention backend reusing llmhal's reference kernels, an op kernel, its conformance
test, a README and a pyproject. It runs as written on the host CPU, so ``pip install -e`` it and
``llmhal generate`` answers through it; porting replaces its pieces one at a time.
"""

from __future__ import annotations

import argparse
import importlib.util
import keyword
import re
import sys
from pathlib import Path

NAME = re.compile(r"^[a-z][a-z0-9_]*$")
TEMPLATE_NAME = "mynpu"


def render(name: str) -> dict[str, str]:
    """The package's files (relative path -> text) for platform ``name``."""
    from llmhal.entrypoints.platform_template import FILES

    camel = "".join(part.title() for part in name.split("_"))
    out = {}
    for path, text in FILES.items():
        for old, new in (
            (TEMPLATE_NAME, name),
            (TEMPLATE_NAME.title(), camel),
            (TEMPLATE_NAME.upper(), name.upper()),
        ):
            path, text = path.replace(old, new), text.replace(old, new)
        out[path] = text
    return out


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a new platform package here (None: it can)."""
    if not NAME.match(name) or keyword.iskeyword(name):
        return (
            f"{name!r} is not a valid name: use a lower-case Python identifier "
            f"(letters, digits, underscores; e.g. 'acme_npu')"
        )
    from llmhal.platforms.resolver import VLLM_BUILTIN_PLATFORMS

    if name in VLLM_BUILTIN_PLATFORMS:
        return (
            f"{name!r} is one of vLLM's built-in platform names "
            f"({', '.join(sorted(VLLM_BUILTIN_PLATFORMS))}): with vLLM installed beside it, vLLM "
            f"would take the plugin as its own activated platform and fail; choose another name "
            f"(e.g. 'acme_{name}')"
        )
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        where = spec.origin or ", ".join(spec.submodule_search_locations or [])
        return f"a module named {name!r} is already importable here ({where}); choose another name"
    from importlib.metadata import entry_points

    taken = {ep.name for ep in entry_points(group="vllm.platform_plugins")}
    if name in taken:
        return (
            f"a platform plugin named {name!r} is already installed (installed: "
            f"{', '.join(sorted(taken))}); choose another name"
        )
    return None


def write_package(name: str, folder: Path) -> list[Path]:
    """Write the package for ``name`` into ``folder`` (which must not hold files yet)."""
    files = render(name)
    written = []
    for rel, text in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmhal new-platform",
        description="Write a complete llmhal platform package (probe, platform, attention backend, "
        "op kernel, tests, README, pyproject) that runs on the host CPU until you port it.",
    )
    p.add_argument("name", help="the platform's name: its import package and entry point")
    p.add_argument(
        "--dir", type=Path, default=None, help="where to write the package (default: ./NAME)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    why = name_problem(args.name)
    if why:
        print(f"llmhal new-platform: {why}", file=sys.stderr)
        return 2
    folder: Path = args.dir if args.dir is not None else Path(args.name)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        print(
            f"llmhal new-platform: {folder} already exists and is not an empty folder; "
            f"give another --dir",
            file=sys.stderr,
        )
        return 2
    written = write_package(args.name, folder)
    print(f"Wrote the {args.name} platform package to {folder} ({len(written)} files):")
    for path in written:
        print(f"  {path}")
    print(
        f"\nNext:\n"
        f"  pip install -e {folder}\n"
        f"  llmhal doctor                        # Platform: {args.name}, selected by: probe\n"
        f"  pytest --llmhal-platform={args.name}   # the conformance kit\n"
        f'  llmhal generate --prompt "What is the capital of France?"\n'
        f"Then port {args.name}/device.py, attention_impl.py and ops.py to your runtime "
        f"(docs/writing-a-platform.md walks through each file)."
    )
    return 0
