"""Arrows point one way: core never reaches for a vendor, vendors never reach for each other.

An AST scan of the source (it also sees imports inside functions and ``import_module("...")``
strings), plus the import-linter contracts in ``.importlinter``.
"""

from __future__ import annotations

import ast
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE_DIRS = (ROOT / "core", ROOT / "platforms")
VENDOR_PACKAGES = {
    "llmhal_cpu": ROOT / "platforms_cpu",
    "llmhal_cuda": ROOT / "platforms_cuda",
    "llmhal_rocm": ROOT / "platforms_rocm",
}
FORBIDDEN_IN_CORE = {
    *VENDOR_PACKAGES,
    "pynvml",
    "amdsmi",
    "flash_attn",
    "flashinfer",
    "aiter",
    "intel_extension_for_pytorch",
}
VENDOR_PREDICATES = {"is_cuda", "is_rocm", "is_hip", "is_xpu", "is_tpu", "is_cuda_alike", "is_npu"}
VENDOR_NAMES = {"cuda", "rocm", "hip", "xpu", "tpu"}
# Calls whose first string argument names a module to import.
DYNAMIC_IMPORTS = {"import_module", "require", "find_spec", "is_available", "__import__"}


def _python_files(*roots: Path) -> Iterator[Path]:
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if not {".venv", "build", "__pycache__"} & set(path.parts):
                yield path


def _imported_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, dotted module) for every import statement and dynamic import by string."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            for alias in node.names:  # from torch import cuda
                yield node.lineno, f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in DYNAMIC_IMPORTS and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield node.lineno, arg.value


def _is_forbidden(module: str, forbidden: set[str]) -> bool:
    return (
        module.split(".")[0] in forbidden
        or module == "torch.cuda"
        or module.startswith("torch.cuda.")
    )


def _vendor_naming(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """is_cuda()-style predicates, torch.cuda attribute use, and `x.name == "cuda"` comparisons."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in VENDOR_PREDICATES:
                yield node.lineno, f".{node.attr}"
            if (
                node.attr == "cuda"
                and isinstance(node.value, ast.Name)
                and node.value.id == "torch"
            ):
                yield node.lineno, "torch.cuda"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name in VENDOR_PREDICATES:
                yield node.lineno, f"def {node.name}"
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = {
                s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)
            }
            attrs = {s.attr for s in sides if isinstance(s, ast.Attribute)}
            if names & VENDOR_NAMES and attrs & {"name", "device_type", "type"}:
                yield node.lineno, f"compares a platform to {sorted(names & VENDOR_NAMES)[0]!r}"


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_core_never_imports_or_names_a_vendor():
    found = []
    for path in _python_files(*CORE_DIRS):
        tree = ast.parse(path.read_text(), str(path))
        found += [
            f"{_rel(path)}:{line}: imports {mod}"
            for line, mod in _imported_modules(tree)
            if _is_forbidden(mod, FORBIDDEN_IN_CORE)
        ]
        found += [f"{_rel(path)}:{line}: {what}" for line, what in _vendor_naming(tree)]
    assert not found, "core must ask the platform, not name a vendor:\n" + "\n".join(found)


def _monkeypatches(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Assignments to attributes of anything imported from llmhal, and setattr() on it."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {
                (a.asname or a.name).split(".")[0]
                for a in node.names
                if a.name.startswith("llmhal.") or a.name == "llmhal"
            }
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "llmhal":
            bound |= {a.asname or a.name for a in node.names}

    def root(expr: ast.expr) -> str | None:
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args
        ):
            if root(node.args[0]) in bound:
                yield node.lineno, "setattr on an llmhal object"
        for t in targets:
            if isinstance(t, ast.Attribute) and root(t) in bound:
                yield node.lineno, f"assigns {ast.unparse(t)}"


@pytest.mark.parametrize("package", sorted(VENDOR_PACKAGES))
def test_vendor_packages_stay_in_their_lane(package):
    others = set(VENDOR_PACKAGES) - {package}
    found = []
    for path in _python_files(VENDOR_PACKAGES[package]):
        tree = ast.parse(path.read_text(), str(path))
        found += [
            f"{_rel(path)}:{line}: imports {mod}"
            for line, mod in _imported_modules(tree)
            if mod.split(".")[0] in others
        ]
        if "tests" not in path.relative_to(VENDOR_PACKAGES[package]).parts:
            found += [f"{_rel(path)}:{line}: {what}" for line, what in _monkeypatches(tree)]
    assert not found, (
        f"{package} must depend only on llmhal, never on another platform package, and must not "
        f"monkeypatch llmhal (add a hook to core instead):\n" + "\n".join(found)
    )


def test_the_scan_catches_violations():
    bad = ast.parse(
        "import torch.cuda\nfrom llmhal_cuda import x\nrequire('flash_attn')\n"
        "def f(p):\n    return p.name == 'cuda' or p.is_rocm()\n"
    )
    mods = [m for _, m in _imported_modules(bad) if _is_forbidden(m, FORBIDDEN_IN_CORE)]
    assert mods == ["torch.cuda", "llmhal_cuda", "llmhal_cuda.x", "flash_attn"]
    assert [w for _, w in _vendor_naming(bad)] in (
        ["compares a platform to 'cuda'", ".is_rocm"],
        [".is_rocm", "compares a platform to 'cuda'"],
    )
    patch = ast.parse(
        "import llmhal.platforms as lp\nfrom llmhal import envs\nlp.current_platform = 1\nsetattr(envs, 'x', 2)\n"
    )
    assert [w for _, w in _monkeypatches(patch)] == [
        "assigns lp.current_platform",
        "setattr on an llmhal object",
    ]


def test_import_linter_contracts_hold():
    proc = subprocess.run(
        [str(ROOT / "ci" / "lint-imports")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "BROKEN" not in proc.stdout
