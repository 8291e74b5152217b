"""Loading shows its stages on stderr: config, tokenizer, a tensor count, kernels, KV cache."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from llmhal import LLM
from llmhal.model_loader.checkpoint import open_checkpoint
from llmhal.model_loader.progress import LoadProgress
from llmhal.model_loader.source import resolve_source
from llmhal.testing.gguf_files import write_tiny_gguf
from llmhal.testing.tiny_models import make_tiny_model


def _lines(err: str) -> list[str]:
    """What the terminal showed, one entry per redraw, padding stripped."""
    return [part.strip() for part in err.replace("\n", "\r").split("\r") if part.strip()]


def test_stages_tensor_count_and_final_line(capsys):
    p = LoadProgress("m.gguf", enabled=True)
    p.stage("config")
    assert list(p.tensors(iter(range(3)), 3)) == [0, 1, 2]
    p.finish("gguf, 1.0 MiB")
    err = capsys.readouterr().err
    shown = _lines(err)
    assert shown[0] == "Loading m.gguf: config ..."
    assert "Loading m.gguf: weights 3/3 tensors" in shown
    assert shown[-1].startswith("Loaded m.gguf (gguf, 1.0 MiB) in ") and shown[-1].endswith(" s")
    assert err.endswith("\n") and err.count("\n") == 1  # one line on screen, rewritten


def test_disabled_progress_writes_nothing_and_passes_items_through(capsys):
    p = LoadProgress("m", enabled=False)
    p.stage("config")
    assert list(p.tensors(["a", "b"], 2)) == ["a", "b"]
    p.finish()
    p.abandon()
    assert capsys.readouterr().err == ""


def test_default_follows_whether_stderr_is_a_terminal(monkeypatch):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert LoadProgress("m").enabled
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert not LoadProgress("m").enabled


def test_abandon_clears_the_line(capsys):
    p = LoadProgress("m", enabled=True)
    p.stage("tokenizer")
    p.abandon()
    err = capsys.readouterr().err
    assert err.endswith("\r") and err.split("\r")[-2].strip() == ""


def test_llm_shows_every_stage_when_asked_and_nothing_by_default(tmp_path, capsys):
    folder = str(tmp_path / "tiny")
    make_tiny_model(folder, "llama")
    capsys.readouterr()  # transformers' own bar from saving it
    with safe_open(f"{folder}/model.safetensors", framework="pt") as f:
        n = len(list(f.keys()))
    LLM(folder, dtype="float32", max_model_len=64)
    assert capsys.readouterr().err == ""  # captured stderr is not a terminal
    LLM(folder, dtype="float32", max_model_len=64, load_progress=True)
    shown = _lines(capsys.readouterr().err)
    name = folder.rstrip("/").rsplit("/", 1)[-1]
    stages = [s.split(": ", 1)[1] for s in shown if s.startswith(f"Loading {name}: ")]
    assert stages[:2] == ["config ...", "tokenizer ..."]
    assert f"weights {n}/{n} tensors" in stages
    assert stages[-3:] == [
        "preparing weights for the kernels ...",
        "KV cache ...",
        "warming up ...",
    ]
    assert shown[-1].startswith(f"Loaded {name} (float32, ")


def test_gguf_weights_are_counted(tmp_path, capsys):
    path = write_tiny_gguf(tmp_path / "tiny.gguf").path
    ckpt = open_checkpoint(resolve_source(str(path)))
    n = len(ckpt.gguf.tensors)
    names = [name for name, _ in ckpt.weights(LoadProgress("tiny.gguf", enabled=True))]
    assert len(names) == n
    assert f"Loading tiny.gguf: weights {n}/{n} tensors" in _lines(capsys.readouterr().err)


def test_a_failed_load_leaves_a_clean_line_for_its_error(tmp_path, capsys):
    path = write_tiny_gguf(tmp_path / "notok.gguf").path  # no tokenizer metadata
    with pytest.raises(ValueError, match=r"notok.gguf has no tokenizer.*--tokenizer"):
        LLM(str(path), load_progress=True)
    err = capsys.readouterr().err
    assert "Loading notok.gguf: tokenizer ..." in _lines(err)
    assert err.endswith("\r") and "Loaded" not in err
