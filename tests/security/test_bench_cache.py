"""``llmhal bench quantization`` reads its derived checkpoints back only from a folder of the user's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmhal.benchmarks import quantization
from llmhal.utils import private_dir


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch, tmp_path):
    monkeypatch.setattr(private_dir, "_fresh", {})
    monkeypatch.setattr(private_dir, "_warned", set())
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))


def test_untrusted_derived_checkpoints_are_built_again(tmp_path, monkeypatch):
    built: list[Path] = []

    def requantize(src: str, dst: Path) -> Path:
        if not dst.exists():
            dst.write_bytes(b"GGUF ours")
            built.append(dst)
        return dst

    monkeypatch.setattr(quantization, "requantize_gguf", requantize)
    monkeypatch.setenv("LLMHAL_CACHE_DIR", str(tmp_path / "cache"))
    root = quantization._workdir(None)
    assert root == tmp_path / "cache" / "bench"
    planted = root / "smollm2-q8_0.gguf"
    planted.write_bytes(b"GGUF theirs")
    planted.chmod(0o666)  # anyone could have written it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "smollm2-bf16").symlink_to(elsewhere)
    quantization.prepare(["q8_0"], "model.gguf", root)
    assert built == [planted] and planted.read_bytes() == b"GGUF ours"
    assert not (root / "smollm2-bf16").exists() and elsewhere.is_dir()  # the link, not its target
    quantization.prepare(["q8_0"], "model.gguf", root)
    assert built == [planted]  # the user's own is reused


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root")
def test_another_users_bench_folder_is_not_used(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    theirs.chmod(0o777)
    monkeypatch.setenv("LLMHAL_CACHE_DIR", str(theirs))
    root = quantization._workdir(None)
    assert root.parent == tmp_path and root.name.startswith("llmhal-bench-")
    assert not (theirs / "bench").exists()
    assert quantization._workdir(theirs) == root
